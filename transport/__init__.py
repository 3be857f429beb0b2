"""transport: the ZeroMQ fabric of the fastio stack.

``transport`` knows sockets, processes and time; it moves :mod:`fastio` frames and reads
only the fabric envelope (:mod:`fastio.fabric_msgs`). Rooms:

- :mod:`transport.sockets`: socket options, HWMs, size limits, CURVE, the asyncio pump
- :mod:`transport.worker`: the generation worker (ROUTER) hosting a generate handler
- :mod:`transport.client`: the rollout client (a DEALER per worker)
- :mod:`transport.control`: pause / resume / abort / health of all workers
- :mod:`transport.engine`: a reference engine (tiny torch LM on CPU)

The wire protocol is specified in ``docs/PROTOCOL.md`` (section "Fabric").
"""

from typing import TYPE_CHECKING, Any

from transport.client import (
    ClientConfig,
    FabricClient,
    GenerateFuture,
    SyncFabricClient,
    WorkerInfo,
)
from transport.control import FabricController
from transport.errors import (
    BadAddress,
    ClientClosed,
    ControlError,
    IncompatibleWorkers,
    NoWorkerAvailable,
    NoWorkers,
    RemoteError,
    RequestAborted,
    RequestTimeout,
    TransportError,
)
from transport.sockets import CurveConfig

if TYPE_CHECKING:
    from transport.engine import ReferenceEngine, TinyLM
    from transport.worker import RequestContext, WorkerConfig, WorkerServer, echo_handler

# Imported on first use: the engine needs torch, which a rollout client does not, and
# ``python -m transport.worker`` must not find its module imported by the package.
_LAZY = {
    "ReferenceEngine": "transport.engine",
    "TinyLM": "transport.engine",
    "RequestContext": "transport.worker",
    "WorkerConfig": "transport.worker",
    "WorkerServer": "transport.worker",
    "echo_handler": "transport.worker",
}

__all__ = [
    "BadAddress",
    "ClientClosed",
    "ClientConfig",
    "ControlError",
    "CurveConfig",
    "FabricClient",
    "FabricController",
    "GenerateFuture",
    "IncompatibleWorkers",
    "NoWorkerAvailable",
    "NoWorkers",
    "ReferenceEngine",
    "RemoteError",
    "RequestAborted",
    "RequestContext",
    "RequestTimeout",
    "SyncFabricClient",
    "TinyLM",
    "TransportError",
    "WorkerConfig",
    "WorkerInfo",
    "WorkerServer",
    "echo_handler",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'transport' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
