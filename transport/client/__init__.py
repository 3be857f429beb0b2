"""Rollout side: an asyncio client that spreads requests over generation workers.

One DEALER per worker carries every request to it, matched by a per-submission id in
an in-flight table, so thousands of requests share one connection. Per request:

* **Scheduling** (:mod:`~transport.client.scheduling`): the live worker with a free
  slot and the least load (this client's requests there plus the others' the worker
  reports in its pongs); requests with the same ``rid`` go to the same worker while it
  lives (KV-cache reuse). At most ``max_in_flight_per_worker`` on a worker; the rest
  wait in the client's queue, never in a socket.
* **Liveness** (:mod:`~transport.client.liveness`): the client pings every worker each
  ``heartbeat_interval``; only missed pongs kill (``heartbeat_liveness`` intervals of
  silence), never a slow answer. A dead worker's requests are re-sent elsewhere under
  new ids after an exponential back-off with jitter, so a late answer from it is
  recognised as stale and dropped. A restarted worker rejoins. With no live worker for
  ``connect_timeout``, calls fail with :class:`~transport.NoWorkerAvailable`, which
  says what was seen at each address (never answered, a refused CURVE handshake).
* **Accumulating** (:mod:`~transport.client.calls`): an interrupted attempt (a pause
  for a weight update) or a lost one keeps its output, and the rest is re-submitted
  as a continuation; the caller gets one :class:`~fastio.LLMResponse` whose
  ``output_versions`` say which weight version produced each token, and ``on_chunk``
  sees each output position once.
* **The result** (:mod:`~transport.client.future`): a :class:`GenerateFuture`, a
  plain ``asyncio.Future`` that every asyncio API takes.
* **Timeouts and cancellation**: past its timeout, or when its future is cancelled, a
  request is cancelled on its worker.
* **Sync use** (:mod:`~transport.client.sync`): :class:`SyncFabricClient`.
"""

from transport.client.config import ClientConfig
from transport.client.fabric import FabricClient
from transport.client.future import GenerateFuture
from transport.client.sync import SyncFabricClient
from transport.client.workers import WorkerInfo

__all__ = ["ClientConfig", "FabricClient", "GenerateFuture", "SyncFabricClient", "WorkerInfo"]
