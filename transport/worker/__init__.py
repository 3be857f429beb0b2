"""Generation worker: a ZeroMQ ROUTER hosting a generate handler.

Modules, one concern each (the thread that runs each is named in its docstring):

- :mod:`transport.worker.server`: :class:`WorkerServer`, which owns the parts below;
  requests, controls and dead clients on the engine's loop
- :mod:`transport.worker.iothread`: the socket thread (pings, bytes, bad input)
- :mod:`transport.worker.config`: :class:`WorkerConfig`
- :mod:`transport.worker.context`: :class:`RequestContext` and the streams it sends
- :mod:`transport.worker.pausing`: the pause gate (slots, pause, resume)
- :mod:`transport.worker.counters`: the one counters object (status and Prometheus)
- :mod:`transport.worker.eager`: the eager start of handlers
- :mod:`transport.worker.jobs`: background jobs (a weight subscriber, say)
- :mod:`transport.worker.lost`: replies lost to unreachable clients
- :mod:`transport.worker.echo`: the echo engine
- :mod:`transport.worker.cli`: ``python -m transport.worker``

Run one as a process::

    python -m transport.worker --bind tcp://127.0.0.1:5555 --engine reference
"""

from transport.worker.cli import main
from transport.worker.config import WorkerConfig
from transport.worker.context import RequestContext
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
