"""transport: the ZeroMQ fabric of the fastio stack.

``transport`` knows sockets, processes and time; it moves :mod:`fastio` frames and reads
only the fabric envelope (:mod:`fastio.fabric_msgs`). Rooms:

- :mod:`transport.sockets`: socket options, HWMs, size limits, CURVE, the asyncio pump
- :mod:`transport.worker`: the generation worker (ROUTER) hosting a generate handler
- :mod:`transport.client`: the rollout client (a DEALER per worker)
- :mod:`transport.control`: pause / resume / abort / health of all workers
- :mod:`transport.engines`: the public engine interface (:class:`Engine`), the registry
  of ``--engine`` names, the SGLang and vLLM bridges
- :mod:`transport.engine`: a reference engine (tiny torch LM on CPU)
- :mod:`transport.addresses`: host names checked, wildcard hosts made reachable
- :mod:`transport.collector`: the cyclic GC's setting for processes with many requests

The rooms are imported on first use: ``import transport`` loads only the errors, and
the base install (no torch) serves the client, the controller and the echo worker.

The wire protocol is specified in ``docs/PROTOCOL.md`` (section "Fabric").
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

# Imported on first use, so that ``import transport.weights.bucket`` (or any one room)
# loads neither the client nor the worker; the engine needs torch, which a rollout
# client does not; and ``python -m transport.worker`` must not find its module
# imported by the package.
_LAZY = {
    "ClientConfig": "transport.client",
    "ControllerConfig": "transport.control",
    "CurveConfig": "transport.sockets",
    "Engine": "transport.engines",
    "FabricClient": "transport.client",
    "FabricController": "transport.control",
    "GenerateFuture": "transport.client",
    "GenerationContext": "transport.engines",
    "ReferenceEngine": "transport.engine",
    "RequestContext": "transport.worker",
    "SyncFabricClient": "transport.client",
    "TinyLM": "transport.engine",
    "WorkerConfig": "transport.worker",
    "WorkerInfo": "transport.client",
    "WorkerServer": "transport.worker",
    "echo_handler": "transport.worker",
    "tune_gc": "transport.collector",
}

__all__ = [
    "BadAddress",
    "ClientClosed",
    "ClientConfig",
    "ControlError",
    "ControllerConfig",
    "CurveConfig",
    "Engine",
    "FabricClient",
    "FabricController",
    "GenerateFuture",
    "GenerationContext",
    "IncompatibleWorkers",
    "NoWorkerAvailable",
    "NoWorkers",
    "PoisonRequest",
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
    "tune_gc",
]


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
