"""Generation worker: a ZeroMQ ROUTER hosting a generate handler.

:class:`WorkerServer` (:mod:`~transport.worker.server`, the engine's loop) owns its
parts: the socket thread (:mod:`~transport.worker.iothread`), the pause gate, the
counters, the lost replies and the request contexts. Run one as a process::

    python -m transport.worker --bind tcp://127.0.0.1:5555 --engine reference
"""

from transport.worker.cli import main
from transport.worker.config import WorkerConfig
from transport.worker.echo import echo_handler
from transport.worker.requests import RequestContext
from transport.worker.server import Handler, InvalidHandlerOutput, WorkerServer

__all__ = [
    "Handler",
    "InvalidHandlerOutput",
    "RequestContext",
    "WorkerConfig",
    "WorkerServer",
    "echo_handler",
    "main",
]
