"""transport: the ZeroMQ fabric of the fastio stack.

The rooms (:mod:`transport.sockets`, :mod:`transport.worker`, :mod:`transport.client`,
:mod:`transport.control`, :mod:`transport.engines`, :mod:`transport.weights`, ...) are
imported on first use: ``import transport`` loads only the errors, and the base install
(no torch) serves the client, the controller and the echo worker. The wire protocol:
``docs/PROTOCOL.md``.
"""

from typing import TYPE_CHECKING, Any

from transport.errors import (
    BadAddress,
    ClientClosed,
    ControlError,
    IncompatibleWorkers,
    NoWorkerAvailable,
    NoWorkers,
    PoisonRequest,
    RemoteError,
    RequestAborted,
    RequestTimeout,
    TransportError,
)

if TYPE_CHECKING:
    from transport.client import (
        ClientConfig,
        FabricClient,
        GenerateFuture,
        SyncFabricClient,
        WorkerInfo,
    )
    from transport.collector import tune_gc
    from transport.control import ControllerConfig, FabricController
    from transport.engine import ReferenceEngine, TinyLM
    from transport.engines import Engine, GenerationContext
    from transport.sockets import CurveConfig
    from transport.worker import RequestContext, WorkerConfig, WorkerServer, echo_handler

# Imported on first use: one room loads no other, and ``python -m transport.worker``
# must not find its module imported by the package.
_MODULES = {
    "transport.client": (
        "ClientConfig", "FabricClient", "GenerateFuture", "SyncFabricClient", "WorkerInfo"
    ),
    "transport.collector": ("tune_gc",),
    "transport.control": ("ControllerConfig", "FabricController"),
    "transport.engine": ("ReferenceEngine", "TinyLM"),
    "transport.engines": ("Engine", "GenerationContext"),
    "transport.sockets": ("CurveConfig",),
    "transport.worker": ("RequestContext", "WorkerConfig", "WorkerServer", "echo_handler"),
}  # fmt: skip
_LAZY = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "BadAddress", "ClientClosed", "ClientConfig", "ControlError", "ControllerConfig", "CurveConfig",
    "Engine", "FabricClient", "FabricController", "GenerateFuture", "GenerationContext",
    "IncompatibleWorkers", "NoWorkerAvailable", "NoWorkers", "PoisonRequest", "ReferenceEngine",
    "RemoteError", "RequestAborted", "RequestContext", "RequestTimeout", "SyncFabricClient",
    "TinyLM", "TransportError", "WorkerConfig", "WorkerInfo", "WorkerServer", "echo_handler",
    "tune_gc",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    import importlib

    module = _LAZY.get(name)
    if module is not None:
        return getattr(importlib.import_module(module), name)
    if name.startswith("__"):
        raise AttributeError(f"module 'transport' has no attribute {name!r}")
    # ``import transport`` then ``transport.control.X``: the room is imported on first use.
    try:
        return importlib.import_module(f"transport.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"transport.{name}":
            raise
        raise AttributeError(f"module 'transport' has no attribute {name!r}") from None
