"""A minimal ZeroMQ driver of the ``ipc`` path: one ROUTER on the trainer, one DEALER per
worker, carrying the messages of :mod:`fastio.ipc_msgs` (no pickle).

It shows the whole contract of :class:`~transport.weights.routes.ipc.IpcExporter` and
:class:`~transport.weights.routes.ipc.IpcImporter` with real sockets, and serves the tests and
the benchmark; the weight publisher and subscriber can carry the same messages on their
own control sockets instead.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import zmq

import fastio
from fastio.errors import DecodeError
from fastio.ipc_msgs import IpcAck, IpcHello, IpcOffer, IpcReady
from fastio.versions import VERSION_1
from transport.weights.routes.ipc import IpcExporter, IpcImporter, IpcRefused

# No token arrays here: version 1, which every release reads.
_encode = VERSION_1.encode

__all__ = ["IpcOutcomes", "IpcResult", "IpcTrainerLink", "IpcWorkerLink"]

_TO_TRAINER = Union[IpcHello, IpcAck]  # noqa: UP007
_TO_WORKER = Union[IpcOffer, IpcReady]  # noqa: UP007


@dataclass
class IpcResult:
    """Outcome of a version: the last ack of each worker that applied it, and why the
    others did not (``failed``: refused a bucket, process gone, not done in time)."""

    version: int
    applied: dict[str, IpcAck]
    failed: dict[str, str]

    @property
    def ok(self) -> bool:
        """Every worker applied the version."""
        return not self.failed


@dataclass
class IpcOutcomes:
    """How each version ended on each worker it was sent to, beside an
    :class:`IpcExporter` (which keeps only what slot reuse needs): wrap the exporter's
    ``send`` with :meth:`sending`, hand every ack to :meth:`ack`."""

    exporter: IpcExporter
    sent: dict[int, set[str]] = field(default_factory=dict)  # version -> workers
    applied: dict[int, dict[str, IpcAck]] = field(default_factory=dict)  # its last bucket
    failed: dict[int, dict[str, str]] = field(default_factory=dict)

    def sending(self, send: Callable[[str, IpcReady], None]) -> Callable[[str, IpcReady], None]:
        """``send``, noting who each version went to."""

        def noting(wid: str, msg: IpcReady) -> None:
            self.sent.setdefault(msg.version, set()).add(wid)
            send(wid, msg)

        return noting

    def ack(self, ack: IpcAck) -> None:
        """Hand ``ack`` to the exporter and note what it says of its version."""
        self.exporter.handle_ack(ack)
        failed = self.failed.setdefault(ack.version, {})
        if ack.bucket < 0 or ack.worker_id in failed:
            return
        if not ack.ok:
            failed[ack.worker_id] = ack.error or "refused"
        elif ack.bucket == len(self.exporter.layout) - 1:
            self.applied.setdefault(ack.version, {})[ack.worker_id] = ack

    def result(
        self, version: int, *, wait: Callable[[float], object], timeout: float = 60.0
    ) -> IpcResult:
        """Wait until every worker ``version`` was sent to has applied it, refused it or
        is gone (up to ``timeout`` seconds), calling ``wait`` as the exporter's publish."""
        targets = self.sent.get(version, set())
        applied = self.applied.setdefault(version, {})
        failed = self.failed.setdefault(version, {})

        def settled() -> bool:
            self.exporter.reap()
            ws = self.exporter.workers
            return all(t not in ws or t in applied or t in failed for t in targets)

        deadline = time.monotonic() + timeout
        while not settled() and (left := deadline - time.monotonic()) > 0:
            wait(min(left, 0.2))
        out = IpcResult(version, {}, {})
        for t in sorted(targets):
            if t in applied:
                out.applied[t] = applied[t]
            elif t in failed or t not in self.exporter.workers:
                out.failed[t] = failed.get(t, "worker gone")
            else:
                out.failed[t] = f"not applied within {timeout} s"
        return out


class IpcTrainerLink:
    """Trainer side: binds a ROUTER (worker id = the DEALER's routing id) and drives an
    :class:`IpcExporter`.

    Examples
    --------
    >>> link = IpcTrainerLink(IpcExporter(model))     # doctest: +SKIP
    >>> link.wait_for_workers(2, timeout=30)          # doctest: +SKIP
    >>> link.publish(model, version=1).ok             # doctest: +SKIP
    True
    """

    def __init__(self, exporter: IpcExporter, endpoint: str = "tcp://127.0.0.1:0") -> None:
        self.exporter = exporter
        self.outcomes = IpcOutcomes(exporter)
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(endpoint)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        #: Refusals sent, by worker id (the worker should take another path).
        self.refused: dict[str, str] = {}
        #: The last Hello of every worker (to offer another exporter's slots).
        self.hellos: dict[str, IpcHello] = {}
        self.bad_frames = 0

    def _send(self, worker_id: str, msg: Any) -> None:
        # A gone peer (ROUTER_MANDATORY raises): its slots are released by reap().
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send_multipart([worker_id.encode(), *_encode(msg)], copy=False)

    def pump(self, timeout: float) -> None:
        """Receive for up to ``timeout`` seconds (returns after the first batch)."""
        if not self.sock.poll(int(timeout * 1000)):
            return
        while True:
            try:
                ident, *frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            wid = bytes(ident.buffer).decode(errors="replace")
            try:
                msg = fastio.decode(frames, _TO_TRAINER)
            except DecodeError:
                self.bad_frames += 1
                continue
            if isinstance(msg, IpcHello):
                if msg.worker_id != wid:
                    continue  # only a peer's own id counts
                self.hellos[wid] = msg
                offer = self.exporter.offer(msg)
                if offer.error:
                    self.refused[wid] = offer.error
                self._send(wid, offer)
            elif msg.worker_id == wid:
                self.outcomes.ack(msg)

    def swap(self, exporter: IpcExporter, workers: list[str]) -> None:
        """Serve ``exporter`` from now on, offering its slots to ``workers`` (ids that
        said hello); the old exporter is closed once they opened the new slots (a
        worker unmaps the old ones when it opens an offer)."""
        old, self.exporter = self.exporter, exporter
        self.outcomes.exporter = exporter
        for wid in workers:
            self._send(wid, exporter.offer(self.hellos[wid]))
        self.wait_for_workers(len(workers))
        old.close()

    def wait_for_workers(self, n: int, timeout: float = 60.0) -> None:
        """Serve until ``n`` workers have opened their slots."""
        deadline = time.monotonic() + timeout
        while sum(w.opened for w in self.exporter.workers.values()) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{n} ipc workers did not open the slots in {timeout} s")
            self.pump(min(left, 0.2))

    def publish(self, state: Any, version: int, timeout: float = 60.0) -> IpcResult:
        """Publish ``version`` and wait until every worker applied it (or failed)."""
        send = self.outcomes.sending(self._send)
        self.exporter.publish(state, version, send=send, wait=self.pump, timeout=timeout)
        return self.outcomes.result(version, wait=self.pump, timeout=timeout)

    def close(self) -> None:
        """Close the socket and the exporter."""
        self.exporter.close()
        self.sock.close(linger=0)


class IpcWorkerLink:
    """Worker side: a DEALER (routing id = the importer's worker id) that says hello,
    opens the offer and applies versions until :meth:`stop` or the trainer's death."""

    def __init__(self, importer: IpcImporter, endpoint: str) -> None:
        self.importer = importer
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, importer.worker_id.encode())
        self.sock.connect(endpoint)
        self._stop = False
        #: Why :meth:`run` returned: ``"stopped"``, ``"trainer gone"`` or a refusal.
        self.reason = ""

    def stop(self) -> None:
        """Make :meth:`run` return at its next poll."""
        self._stop = True

    def run(
        self,
        *,
        on_ready: Callable[[IpcReady], None] | None = None,
        on_version: Callable[[int], None] | None = None,
        poll_s: float = 0.1,
    ) -> str:
        """Serve; returns the reason (also in :attr:`reason`). ``on_ready`` runs before
        each bucket is taken, ``on_version`` after each version completes."""
        imp = self.importer
        self.sock.send_multipart(_encode(imp.hello()))
        while not self._stop:
            if not self.sock.poll(int(poll_s * 1000)):
                if imp.offer is not None and not imp.trainer_alive():
                    imp.abandon()
                    self.reason = "trainer gone"
                    return self.reason
                continue
            try:
                msg = fastio.decode(self.sock.recv_multipart(copy=False), _TO_WORKER)
            except DecodeError:
                continue
            if isinstance(msg, IpcOffer):
                try:
                    ack = imp.open(msg)
                except IpcRefused as exc:
                    self.reason = f"refused: {exc}"
                    return self.reason
                self.sock.send_multipart(_encode(ack))
                continue
            if on_ready is not None:
                on_ready(msg)
            before = imp.version
            for a in imp.on_ready(msg):
                self.sock.send_multipart(_encode(a))
            if on_version is not None and imp.version != before:
                on_version(imp.version)
        self.reason = "stopped"
        return self.reason

    def close(self) -> None:
        """Release the trainer's memory, tell the trainer, close the socket."""
        bye = self.importer.release()
        self.importer.close()
        if bye is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.send_multipart(_encode(bye), zmq.NOBLOCK)
        self.sock.close(linger=1000)
