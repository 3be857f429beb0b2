"""Rollout side: an asyncio client that spreads requests over generation workers, on
the caller's loop (:class:`SyncFabricClient`: in a thread of its own); its parts are in
docs/concepts.md ("How the objects are built")."""

from transport.client.calls import GenerateFuture
from transport.client.fabric import FabricClient, SyncFabricClient
from transport.client.workers import ClientConfig, WorkerInfo

__all__ = ["ClientConfig", "FabricClient", "GenerateFuture", "SyncFabricClient", "WorkerInfo"]
