"""Rollout side: an asyncio client that spreads requests over generation workers.

Everything runs on the caller's asyncio loop (:class:`SyncFabricClient` runs it in a
thread): one DEALER per worker, read and written by a
:class:`~transport.sockets.SocketPump`; only host-name lookups run in the executor.
:class:`FabricClient` owns its parts: the scheduler (:mod:`~transport.client.scheduling`:
least load, same ``rid`` to the same worker), liveness
(:mod:`~transport.client.liveness`: only silence kills; re-sends with back-off), calls
(:mod:`~transport.client.calls`: an interrupted or lost attempt keeps its output) and
counters (``stats``, also in Prometheus).
"""

from transport.client.config import ClientConfig
from transport.client.fabric import FabricClient
from transport.client.future import GenerateFuture
from transport.client.sync import SyncFabricClient
from transport.client.workers import WorkerInfo

__all__ = ["ClientConfig", "FabricClient", "GenerateFuture", "SyncFabricClient", "WorkerInfo"]
