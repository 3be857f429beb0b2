"""Controller: pause, resume, abort and health of every generation worker, from a
synchronous core on the caller's thread (``async`` twins run it in a thread)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ParamSpec

import msgspec
import zmq

from fastio import DecodeError, Decoder, versions
from fastio import fabric_msgs as fm
from transport.addresses import check_address
from transport.errors import ControlError
from transport.options import Positive, Seconds, configure
from transport.sockets import DEFAULT_MAX_MESSAGE_SIZE, CurveConfig, make_dealer

__all__ = ["ControllerConfig", "FabricController"]

#: Worker address -> its status after an operation.
Statuses = dict[str, fm.WorkerStatus]
_P = ParamSpec("_P")


class ControllerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of a :class:`FabricController`: ``timeout``, the default seconds to wait
    for each operation's answers; ``max_message_size`` and ``curve`` (the workers' keys
    when they require them) as in :mod:`transport.sockets`."""

    timeout: Seconds = 60.0
    max_message_size: Positive = DEFAULT_MAX_MESSAGE_SIZE
    curve: CurveConfig | None = None


def _in_thread(op: Callable[_P, Statuses]) -> Callable[_P, Coroutine[Any, Any, Statuses]]:
    @functools.wraps(op)  # its signature, for help() and inspect
    async def run(*args: _P.args, **kwargs: _P.kwargs) -> Statuses:
        # Looked up at call time: a subclass's or a patched method is the one run.
        return await asyncio.to_thread(getattr(args[0], op.__name__), *args[1:], **kwargs)

    run.__name__, run.__qualname__ = f"a{op.__name__}", f"FabricController.a{op.__name__}"
    run.__doc__ = f":meth:`{op.__name__}` without blocking the event loop."
    return run


class FabricController:
    """Sends control operations to every worker and gathers their answers.

    ``config`` and keyword arguments (the fields of :class:`ControllerConfig`) are the
    same settings; a bad one is named by a ``ValueError`` (``TypeError`` if unknown).

    >>> with FabricController(["tcp://127.0.0.1:5555"], timeout=30) as ctl:  # doctest: +SKIP
    ...     ctl.pause()  # then publish weights
    ...     ctl.resume()
    """

    def __init__(
        self, workers: Sequence[str] = (), config: ControllerConfig | None = None, **options: Any
    ) -> None:
        self.config = config = configure(ControllerConfig, config, options, "controller option")
        self.timeout = config.timeout
        self._zctx: zmq.Context[Any] = zmq.Context()
        self._socks: dict[str, zmq.Socket[Any]] = {}
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._dec = Decoder(fm.WORKER_TO_CLIENT, max_message_size=config.max_message_size)
        for address in workers:
            self.add_worker(address)

    @property
    def addresses(self) -> list[str]:
        """The workers this controller drives."""
        return list(self._socks)

    def add_worker(self, address: str) -> None:
        """Drive one more worker."""
        cfg = self.config
        with self._lock:
            if address not in self._socks:
                check_address(address)
                self._socks[address] = make_dealer(
                    self._zctx, address, max_message_size=cfg.max_message_size, curve=cfg.curve
                )

    def remove_worker(self, address: str) -> None:
        """Stop driving a worker."""
        with self._lock:
            sock = self._socks.pop(address, None)
            if sock is not None:
                sock.close(linger=0)

    def request(
        self,
        op: str,
        *,
        timeout: float | None = None,
        strict: bool = True,
        op_timeout: float | None = None,
    ) -> Statuses:
        """Send ``op`` (pause, resume, abort, health) to every worker and wait up to
        ``timeout`` s for the answers; returns each worker's status after it.

        ``strict`` raises :class:`ControlError` if a worker fails or does not answer in
        time; ``op_timeout`` (pause) is how long a worker waits for its generations.
        """
        t = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        op_t = 0.8 * t if op_timeout is None else op_timeout
        statuses: Statuses = {}
        failed: dict[str, str] = {}
        with self._lock:
            for sock in self._socks.values():
                while sock.poll(0):  # answers to earlier, timed-out operations
                    sock.recv_multipart(copy=False)
            # Socket -> (address, seq), before and after its request is sent.
            unsent = {sock: (address, next(self._seq)) for address, sock in self._socks.items()}
            waiting: dict[zmq.Socket[Any], tuple[str, int]] = {}
            while (unsent or waiting) and (left := deadline - time.monotonic()) > 0:
                # ZMQ_IMMEDIATE DEALERs send only on a live connection: POLLOUT first.
                poller = zmq.Poller()
                for sock in (*unsent, *waiting):
                    poller.register(sock, zmq.POLLOUT if sock in unsent else zmq.POLLIN)
                for sock, ev in poller.poll(int(left * 1000) + 1):
                    if ev & zmq.POLLOUT and sock in unsent:
                        msg = fm.Control(seq=unsent[sock][1], op=op, timeout=op_t)
                        with contextlib.suppress(zmq.Again):
                            frames = versions.VERSION_1.encode(msg)
                            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                            waiting[sock] = unsent.pop(sock)
                    elif ev & zmq.POLLIN and sock in waiting:
                        address, seq = waiting[sock]
                        for frames in fm.split(sock.recv_multipart(copy=False)):
                            try:
                                reply = self._dec.decode(frames)
                            except DecodeError as exc:
                                reply = fm.ControlReply(seq, False, f"malformed reply: {exc}")
                            if type(reply) is not fm.ControlReply or reply.seq != seq:
                                continue  # a stale reply
                            if reply.ok:
                                statuses[address] = reply.status
                            else:
                                failed[address] = reply.error
                            waiting.pop(sock, None)
            failed.update({a: f"not reachable within {t} s" for a, _ in unsent.values()})
            failed.update({a: f"no answer within {t} s" for a, _ in waiting.values()})
        if failed and strict:
            text = f"{op} failed on {len(failed)} of {len(self._socks)} workers: {failed}"
            raise ControlError(text, failed, dict(statuses))
        return statuses

    def pause(self, timeout: float | None = None, *, strict: bool = True) -> Statuses:
        """Pause every worker; returns once none is generating (see :meth:`request`)."""
        return self.request("pause", timeout=timeout, strict=strict)

    def resume(self, timeout: float | None = None, *, strict: bool = True) -> Statuses:
        """Let every worker generate again."""
        return self.request("resume", timeout=timeout, strict=strict)

    def abort(self, timeout: float | None = None, *, strict: bool = True) -> Statuses:
        """Abort every request on every worker (their callers get ``RequestAborted``)."""
        return self.request("abort", timeout=timeout, strict=strict)

    def health(self, timeout: float | None = None, *, strict: bool = False) -> Statuses:
        """Status of every worker that answers in time (missing ones are not healthy)."""
        return self.request("health", timeout=timeout, strict=strict)

    apause = _in_thread(pause)
    aresume = _in_thread(resume)
    aabort = _in_thread(abort)
    ahealth = _in_thread(health)

    def close(self) -> None:
        """Close the sockets (linger 0)."""
        with self._lock:
            for sock in self._socks.values():
                sock.close(linger=0)
            self._socks.clear()
            self._zctx.term()

    def __enter__(self) -> FabricController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> FabricController:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
