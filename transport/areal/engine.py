"""``FabricInferenceEngine``: AReaL's ``InferenceEngine`` over the fastio fabric, where
AReaL's ``RemoteSGLangEngine`` speaks HTTP+JSON (``docs/areal.md``)."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from areal.api import InferenceEngine, ModelResponse
from areal.infra.remote_inf_engine import RemoteInfEngine
from areal.infra.workflow_executor import WorkflowExecutor
from areal.utils import logging as areal_logging
from areal.utils import stats_tracker

from fastio.tokens import TokenArray
from transport.areal.convert import to_llm_request, to_model_response
from transport.areal.loops import LoopClients
from transport.areal.weights import disk_root, wait_for_version
from transport.client import ClientConfig, FabricClient
from transport.control import FabricController

__all__ = ["ChunkObserver", "FabricInferenceEngine"]

T = TypeVar("T")

#: ``on_chunk(rid, tokens, logprobs, versions)``: output not delivered before.
ChunkObserver = Callable[[str, TokenArray, TokenArray, TokenArray], None]


class FabricInferenceEngine(RemoteInfEngine):  # type: ignore[misc]
    """AReaL's ``InferenceEngine`` over the fastio fabric. ``config``: AReaL's
    ``InferenceEngineConfig``; ``client_config``: the fabric clients'; ``weights_timeout``:
    seconds a weight update's future waits for every worker; ``on_chunk(rid, tokens,
    logprobs, versions)``: sees the output as it arrives, on the awaiting loop. How each
    method maps (the workflow calls are ``RemoteInfEngine``'s): ``docs/areal.md``.

    >>> engine = FabricInferenceEngine(InferenceEngineConfig(backend="fastio:d1"))  # doctest: +SKIP
    >>> engine.initialize(addr=["tcp://127.0.0.1:5555"])  # doctest: +SKIP
    >>> batch = engine.rollout_batch(data, workflow=RLVRWorkflow(...))  # doctest: +SKIP
    """

    # No HTTP server behind this engine: these stay InferenceEngine's NotImplementedError.
    compute_logp = InferenceEngine.compute_logp
    offload = InferenceEngine.offload
    onload = InferenceEngine.onload

    def __init__(
        self,
        config: Any,
        client_config: ClientConfig | None = None,
        *,
        weights_timeout: float = 300.0,
        on_chunk: ChunkObserver | None = None,
    ) -> None:
        super().__init__(config, backend=None)
        self.client_config = client_config
        self.weights_timeout = weights_timeout
        self.on_chunk = on_chunk
        self._clients: LoopClients | None = None
        self.controller: FabricController | None = None
        self._updates: concurrent.futures.ThreadPoolExecutor | None = None
        self.logger = areal_logging.getLogger("FabricInferenceEngine")

    def initialize(
        self,
        engine_id: str | None = None,
        addr: str | list[str] | None = None,
        train_data_parallel_size: int | None = None,
    ) -> None:
        """Connect to the workers at ``addr`` (default ``$AREAL_LLM_SERVER_ADDRS``), wait
        until each answers and start AReaL's workflow executor."""
        self.engine_id = engine_id or uuid.uuid4().hex
        self.logger = areal_logging.getLogger(f"[FabricInferenceEngine {self.engine_id}]")
        given = [addr] if isinstance(addr, str) else addr
        given = given or os.getenv("AREAL_LLM_SERVER_ADDRS", "").split(",")
        # AReaL passes servers as host:port; the fabric takes ZeroMQ addresses.
        self.addresses = [a if "://" in a else f"tcp://{a}" for a in given if a]
        if not self.addresses:
            raise RuntimeError(
                "No configured fastio workers. Pass their addresses to initialize(addr=...) "
                "or set AREAL_LLM_SERVER_ADDRS."
            )
        timeout = float(self.config.setup_timeout)
        self.controller = FabricController(self.addresses, timeout=min(60.0, timeout))
        try:
            # Raises ControlError naming each worker that did not answer in time.
            self.controller.request("health", timeout=timeout)
            self._clients = LoopClients(self.addresses, self.client_config or ClientConfig())
        except BaseException:
            self.controller.close()
            self.controller = None
            raise
        # Weight-update futures: one thread, so updates complete in the order asked.
        self._updates = concurrent.futures.ThreadPoolExecutor(1, "fabric-weights")
        self.workflow_executor = WorkflowExecutor(config=self.config, inference_engine=self)
        self.workflow_executor.initialize(
            logger=self.logger, train_data_parallel_size=train_data_parallel_size
        )
        self._initialized = True

    def destroy(self) -> None:
        """Stop the executor, close the clients and the controller."""
        super().destroy()  # the workflow executor
        self._workflow_executor = None
        if self._updates is not None:
            # A wait in progress ends by its own timeout; queued ones are dropped.
            self._updates.shutdown(wait=True, cancel_futures=True)
            self._updates = None
        if self._clients is not None:
            # After the executor: its loop cancelled its requests, now closed.
            self._clients.close()
            self._clients = None
        if self.controller is not None:
            self.controller.close()
            self.controller = None

    @property
    def fabric_clients(self) -> dict[Any, FabricClient]:
        """The fabric clients open now, by the event loop each belongs to."""
        return {} if self._clients is None else self._clients.snapshot()

    async def agenerate(self, req: Any) -> Any:
        """AReaL's ``ModelResponse`` for its ``ModelRequest``, on any event loop."""
        clients = _ready(self._clients)
        llm_req = to_llm_request(req)
        client = await clients.get()
        cb = self.on_chunk
        resp = await client.agenerate(
            llm_req,
            timeout=float(self.config.request_timeout),
            on_chunk=None if cb is None else functools.partial(cb, llm_req.rid),
        )
        return to_model_response(req, resp, ModelResponse)

    def _await_version(self, meta: Any, route: str) -> concurrent.futures.Future[None]:
        ctl = _ready(self.controller)
        if meta.version is not None:
            version = int(meta.version)
        else:  # any version newer than every worker reports now
            version = max(s.version for s in ctl.health(strict=True).values()) + 1

        def wait() -> None:
            seen = wait_for_version(ctl, version, self.weights_timeout)
            self.logger.info(
                "version %d on every worker via the %s route: %s", version, route, seen
            )

        return _ready(self._updates).submit(wait)

    def update_weights_from_disk(self, meta: Any) -> concurrent.futures.Future[None]:
        """A future done once every worker loaded ``meta.version`` from the disk route."""
        disk_root(meta)  # a clear error now for a meta that is not a disk one
        return self._await_version(meta, "disk")

    def init_weights_update_group(
        self, meta: Any, xccl_group_ranks: list[int] | None = None
    ) -> concurrent.futures.Future[Any]:
        """Nothing to set up: the future checks that every worker answers."""
        return _ready(self._updates).submit(_ready(self.controller).request, "health", strict=True)

    def update_weights_from_distributed(
        self, meta: Any, param_specs: list[Any]
    ) -> concurrent.futures.Future[None]:
        """A future done once every worker applied ``meta.version`` from the publisher."""
        return self._await_version(meta, "publisher")

    def pause_generation(self) -> None:
        """Pause every worker; returns once none generates."""
        _ready(self.controller).pause()

    def continue_generation(self) -> None:
        """Resume every worker."""
        _ready(self.controller).resume()

    def export_stats(self) -> dict[str, float]:
        """The scalars the workflows recorded (AReaL's ``stats_tracker``)."""
        return stats_tracker.export_all(reduce_group=None)  # type: ignore[no-any-return]

    def launch_server(self, server_args: dict[str, Any]) -> Any:
        raise NotImplementedError(
            "start generation workers with fastio-worker and pass their addresses to "
            "initialize(addr=...)"
        )


def _ready(part: T | None) -> T:
    if part is None:
        raise RuntimeError("the engine is not initialized (call initialize first)")
    return part
