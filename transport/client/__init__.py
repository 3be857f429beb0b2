"""Rollout side: an asyncio client that spreads requests over generation workers.

Loop model: everything runs on the caller's asyncio loop (the one running at
:meth:`FabricClient.start` or the first call); :class:`SyncFabricClient` runs that loop
in a background thread. One DEALER per worker carries all requests to it (matched by a
per-submission id); a :class:`~transport.sockets.SocketPump` per DEALER reads it from
an FD reader callback in batches and sends without blocking. No other thread touches
the sockets; only host-name lookups run in the loop's executor.

* **Scheduling** (:mod:`~transport.client.scheduling`): the live worker with a free
  slot and the least load; requests with the same ``rid`` go to the same worker while
  it lives (KV-cache reuse); at most ``max_in_flight_per_worker`` on a worker, the
  rest wait in the client. The first burst waits for every worker that is up.
* **Liveness** (:mod:`~transport.client.liveness`): pings every
  ``heartbeat_interval``; only silence kills, never a slow answer. A dead worker's
  requests are re-sent elsewhere after a back-off with jitter; a restarted one
  rejoins. With no live worker for ``connect_timeout``, calls fail with
  :class:`~transport.NoWorkerAvailable`, which says what was seen at each address.
* **Calls** (:mod:`~transport.client.calls`): an interrupted (weight update) or lost
  attempt keeps its output and the rest is re-submitted; the caller gets one
  :class:`~fastio.LLMResponse` whose ``output_versions`` name each token's weight
  version, and ``on_chunk`` sees each output position once.
* **The result** (:mod:`~transport.client.future`): a :class:`GenerateFuture`, a plain
  ``asyncio.Future``; cancelling it, or its timeout, cancels the request on its worker.
* **Counts** (:mod:`~transport.client.counters`): ``FabricClient.stats``, also
  exported to Prometheus (:mod:`transport.metrics`).
"""

from transport.client.config import ClientConfig
from transport.client.fabric import FabricClient
from transport.client.future import GenerateFuture
from transport.client.sync import SyncFabricClient
from transport.client.workers import WorkerInfo

__all__ = ["ClientConfig", "FabricClient", "GenerateFuture", "SyncFabricClient", "WorkerInfo"]
