"""Exceptions raised by :mod:`transport` (the tree: ``docs/troubleshooting.md``; a
``fastio.DecodeError`` never reaches a caller: it becomes an Error reply or a logged drop)."""

from __future__ import annotations

from fastio.errors import FastioError

__all__ = [
    "EMPTY_PROMPT", "BadAddress", "ClientClosed", "ControlError", "IncompatibleWorkers",
    "NoWorkerAvailable", "NoWorkers", "PoisonRequest", "RemoteError", "RequestAborted",
    "RequestTimeout", "ResumeRefused", "TransportError",
]  # fmt: skip

#: Why a request with no prompt tokens is refused, by the client and by a worker.
EMPTY_PROMPT = "empty prompt: LLMRequest.input_ids has no tokens (a prompt needs at least one)"


class TransportError(FastioError):
    """Root of every exception raised by transport."""


class RequestTimeout(TransportError, TimeoutError):
    """The request did not finish within its timeout (it was cancelled on its worker)."""


class RemoteError(TransportError):
    """A worker rejected or failed a request: ``code`` (an
    :class:`fastio.fabric_msgs.ErrorCode`) from the ``worker`` at that address."""

    def __init__(self, message: str, *, code: int = 0, worker: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.worker = worker


class RequestAborted(RemoteError):
    """A controller aborted the request on its worker."""


class PoisonRequest(RemoteError):
    """The request's ``max_worker_deaths + 1`` workers each died while running it, so it
    is not sent to another: ``rid``, and ``workers`` in the order they died."""

    def __init__(self, message: str, *, rid: str, workers: tuple[str, ...]) -> None:
        super().__init__(message, worker=workers[-1] if workers else "")
        self.rid = rid
        self.workers = workers


class NoWorkers(TransportError, RuntimeError):
    """The client has no worker to send to."""


class NoWorkerAvailable(NoWorkers):
    """No worker has answered a ping for the client's ``connect_timeout``; ``seen``:
    worker address -> what the client saw there."""

    def __init__(self, message: str, seen: dict[str, str]) -> None:
        super().__init__(message)
        self.seen = seen


class IncompatibleWorkers(NoWorkerAvailable):
    """Every worker answered, and none speaks a protocol version (or token encoding)
    this client can use; ``seen`` names each one's versions."""


class BadAddress(TransportError, ValueError):
    """An address that cannot be connected to (a worker's, for a client or controller) or
    bound."""


class ClientClosed(TransportError, RuntimeError):
    """The client was closed while the request was pending."""


class ControlError(TransportError):
    """A control operation failed on some workers: ``failed`` (address -> why) and
    ``statuses`` (address -> :class:`fastio.fabric_msgs.WorkerStatus`) of the rest."""

    def __init__(self, message: str, failed: dict[str, str], statuses: dict[str, object]) -> None:
        super().__init__(message)
        self.failed = failed
        self.statuses = statuses


class ResumeRefused(RuntimeError):
    """Raised by an ``on_resume`` callback to refuse a resume: the worker stays paused
    and answers ``ok=False`` with this error."""
