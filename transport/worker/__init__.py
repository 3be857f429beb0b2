"""Generation worker: a ZeroMQ ROUTER hosting a generate handler.

Modules, one concern each:

- :mod:`transport.worker.server`: :class:`WorkerServer`, requests on the engine's loop,
  dead clients
- :mod:`transport.worker.iothread`: the socket thread (pings, bytes, bad input)
- :mod:`transport.worker.context`: :class:`WorkerConfig`, :class:`RequestContext`
- :mod:`transport.worker.pausing`: pause / resume / abort and controller operations
- :mod:`transport.worker.eager`: the eager start of handlers
- :mod:`transport.worker.lost`: replies lost to unreachable clients
- :mod:`transport.worker.echo`: the echo engine
- :mod:`transport.worker.cli`: ``python -m transport.worker``

Run one as a process::

    python -m transport.worker --bind tcp://127.0.0.1:5555 --engine reference
"""

from transport.worker.cli import main
from transport.worker.context import RequestContext, WorkerConfig
from transport.worker.echo import echo_handler
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
