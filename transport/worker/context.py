"""What a worker is configured with (:class:`WorkerConfig`) and what a handler knows
about its request (:class:`RequestContext`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fastio import LLMResponse
from fastio import fabric_msgs as fm
from fastio.tokens import TokenArray
from transport import metrics
from transport.sockets import (
    DEFAULT_HWM,
    DEFAULT_MAX_MESSAGE_SIZE,
    DEFAULT_PEER_QUEUE_LIMIT,
    CurveConfig,
)

__all__ = ["InvalidHandlerOutput", "RequestContext", "WorkerConfig", "output_problem"]


@dataclass
class WorkerConfig:
    """Settings of a :class:`~transport.WorkerServer`.

    Parameters
    ----------
    bind:
        Addresses to bind (``tcp://127.0.0.1:0`` picks a free port; ``ipc://path``).
    worker_id:
        Stable name reported in heartbeats and status (default ``host:pid``).
    max_concurrency:
        Handlers running at once; more submissions wait for a slot.
    max_pending:
        Running plus waiting; a Submit beyond it gets an ``OVERLOADED`` Error reply.
    client_timeout:
        A client silent this long (no ping, no message) is presumed dead and its
        requests are cancelled; should it ping again (it had only stalled), each is
        reported to it as ``LOST`` and it re-sends them. Keep it a few times the
        clients' heartbeat interval.
    max_message_size, hwm, curve:
        See :mod:`transport.sockets`.
    peer_queue_limit:
        Bytes of replies the worker holds for one client whose pipe is full (beyond
        ``hwm`` messages in libzmq); past it that client is dropped: its replies are
        discarded, its requests cancelled (reported ``LOST`` if it comes back), and the
        drop is logged and counted (``dropped_peers``). Other clients are never held
        up by one that does not read.
    extra:
        Options for plugins (``--plugin-opt key=value``).
    eager_start:
        Run each handler's first step at once, in the callback that took its Submit
        (as Python 3.12's eager tasks), instead of in a new task on the next loop
        iteration: a handler that returns without awaiting costs no task, and one
        that awaits continues in a task. During that first step
        ``asyncio.current_task()`` is not the request's task; set False for handlers
        that need it (``asyncio.timeout()`` before their first ``await``, say).
    latency_metrics:
        Record the per-request latency histograms of :mod:`transport.metrics`
        (``WORKER_TTFT``, ``WORKER_ITL``, ``WORKER_E2E``). Off by default: each
        observation costs a few microseconds of the worker's time per request, spent
        for nothing where no one scrapes them. ``python -m transport.worker`` turns it on
        with ``--metrics-port``. Request outcomes and errors are always counted;
        without it, answers are added to ``WORKER_REQUESTS{outcome="ok"}`` in batches,
        at most 0.2 s late (each increment takes a lock).
    inline:
        Serve the socket on the handler's loop instead of a thread of its own: for
        handlers that never block (they await an engine that runs elsewhere, in another
        process or a thread), it saves two thread hand-offs per request; a handler
        that blocks then delays pongs too. ``None``: the handler's ``inline``
        attribute decides (:func:`~transport.worker.echo_handler` sets it), else off.
    """

    bind: str | list[str] = "tcp://127.0.0.1:0"
    worker_id: str = ""
    max_concurrency: int = 4096
    max_pending: int = 65536
    client_timeout: float = 10.0
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    hwm: int = DEFAULT_HWM
    curve: CurveConfig | None = None
    peer_queue_limit: int = DEFAULT_PEER_QUEUE_LIMIT
    extra: dict[str, str] = field(default_factory=dict)
    eager_start: bool = True
    inline: bool | None = None
    latency_metrics: bool = False


class _Server(Protocol):
    """What a :class:`RequestContext` uses of its :class:`~transport.WorkerServer`
    (declared here so that this module needs not import the server's)."""

    @property
    def config(self) -> WorkerConfig: ...
    @property
    def paused(self) -> bool: ...
    @property
    def version(self) -> int: ...
    def _schedule_flush(self, ctx: RequestContext) -> None: ...
    def _send(self, peer: bytes, msg: Any) -> None: ...


class RequestContext:
    """What a handler knows about its request besides the request itself.

    Attributes
    ----------
    id:
        The submission id (scoped to the client connection).
    deadline:
        ``time.monotonic()`` by which the client wants the answer (``inf``: none).
    """

    __slots__ = (
        "_aborted",
        "_first",
        "_lp",
        "_ran",
        "_seq",
        "_server",
        "_t0",
        "_tok",
        "_ver",
        "deadline",
        "id",
        "peer",
        "stream",
    )

    def __init__(
        self, server: _Server, peer: bytes, id: int, stream: bool, deadline: float
    ) -> None:
        self._server = server
        self.peer = peer
        self.id = id
        self.stream = stream
        self.deadline = deadline
        self._seq = 0
        self._tok: list[int] = []
        self._lp: list[float] = []
        self._ver: list[int] = []
        self._aborted = False
        self._ran = False  # its task started (see transport.worker.eager.reap)
        self._t0 = time.monotonic()
        self._first = 0.0  # when the first token was emitted (0: none yet)

    @property
    def interrupted(self) -> bool:
        """True once the worker is pausing: return the output so far with
        ``stop_reason="interrupt"`` at the next step."""
        return self._server.paused

    @property
    def version(self) -> int:
        """The weight version the worker serves now (its engine's ``version``)."""
        return self._server.version

    def emit(self, token: int, logprob: float = 0.0, version: int = 0) -> None:
        """Stream one generated token. Tokens emitted in the same loop iteration travel
        in one Stream message; does nothing when the client asked for no stream.
        Call it from the worker's loop (the thread running the handler's coroutine)."""
        if not self._first:
            self._first = time.monotonic()
            if self._server.config.latency_metrics:
                metrics.WORKER_TTFT.observe(self._first - self._t0)
        if not self.stream:
            return
        if not self._tok:
            self._server._schedule_flush(self)
        self._tok.append(token)
        self._lp.append(logprob)
        self._ver.append(version)

    def _flush(self) -> None:
        if not self._tok:
            return
        msg = fm.Stream(
            id=self.id,
            seq=self._seq,
            output_tokens=TokenArray(np.array(self._tok, dtype=np.int32)),
            output_logprobs=TokenArray(np.array(self._lp, dtype=np.float32)),
            output_versions=TokenArray(np.array(self._ver, dtype=np.int32)),
        )
        self._seq += 1
        self._tok, self._lp, self._ver = [], [], []
        self._server._send(self.peer, msg)

    def _finished(self, n_tokens: int) -> None:
        """Latency metrics of a request that answered a Result of ``n_tokens`` (called
        only with ``WorkerConfig.latency_metrics``)."""
        now = time.monotonic()
        metrics.WORKER_E2E.observe(now - self._t0)
        if not self._first:
            # Nothing streamed: the first token left with the Result.
            if n_tokens:
                metrics.WORKER_TTFT.observe(now - self._t0)
        elif n_tokens > 1:
            metrics.WORKER_ITL.observe((now - self._first) / (n_tokens - 1))


class InvalidHandlerOutput(ValueError):
    """A handler returned something that cannot be sent as a Result (the client gets
    ``HANDLER_ERROR`` with this message)."""


_STOP_REASONS = frozenset(("length", "stop", "interrupt", "abort"))


def output_problem(resp: Any) -> str | None:
    """Why ``resp`` cannot be sent as a Result, or None."""
    if type(resp) is LLMResponse:
        # The usual answer: its construction made the arrays TokenArrays.
        tok, lp, ver = resp.output_tokens, resp.output_logprobs, resp.output_versions
        if type(tok) is TokenArray and type(lp) is TokenArray and type(ver) is TokenArray:
            n = len(tok._a)
            if len(lp._a) == n and len(ver._a) == n and resp.stop_reason in _STOP_REASONS:
                return None
    if not isinstance(resp, LLMResponse):
        return f"the handler returned {type(resp).__name__}, not an LLMResponse"
    try:
        n = len(resp.output_tokens)
        n_lp, n_ver = len(resp.output_logprobs), len(resp.output_versions)
    except TypeError as exc:
        return f"output arrays without a length ({exc})"
    if n_lp != n or n_ver != n:
        return (
            "output_tokens, output_logprobs and output_versions must have equal lengths, "
            f"got {n}, {n_lp} and {n_ver}"
        )
    if resp.stop_reason not in _STOP_REASONS:
        return f"stop_reason must be one of {sorted(_STOP_REASONS)}, got {resp.stop_reason!r}"
    return None
