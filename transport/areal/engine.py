"""``FabricInferenceEngine``: AReaL's ``InferenceEngine`` over the fastio fabric, where
AReaL's ``RemoteSGLangEngine`` speaks HTTP+JSON (``docs/areal.md``)."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from areal.api import InferenceEngine, ModelResponse, RolloutWorkflow
from areal.infra.remote_inf_engine import GroupedRolloutWorkflow
from areal.infra.workflow_executor import WorkflowExecutor
from areal.utils import logging as areal_logging
from areal.utils import stats_tracker
from areal.utils.dynamic_import import import_from_string

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


class FabricInferenceEngine(InferenceEngine):  # type: ignore[misc]
    """AReaL's ``InferenceEngine`` over the fastio fabric. ``config``: AReaL's
    ``InferenceEngineConfig``; ``client_config``: the fabric clients'; ``weights_timeout``:
    seconds a weight update's future waits for every worker; ``on_chunk(rid, tokens,
    logprobs, versions)``: sees the output as it arrives, on the awaiting loop.

    >>> engine = FabricInferenceEngine(InferenceEngineConfig(backend="fastio:d1"))  # doctest: +SKIP
    >>> engine.initialize(addr=["tcp://127.0.0.1:5555"])  # doctest: +SKIP
    >>> batch = engine.rollout_batch(data, workflow=RLVRWorkflow(...))  # doctest: +SKIP
    """

    def __init__(
        self,
        config: Any,
        client_config: ClientConfig | None = None,
        *,
        weights_timeout: float = 300.0,
        on_chunk: ChunkObserver | None = None,
    ) -> None:
        self.config = config
        self.client_config = client_config
        self.weights_timeout = weights_timeout
        self.on_chunk = on_chunk
        self.addresses: list[str] = []
        self._clients: LoopClients | None = None
        self.controller: FabricController | None = None
        self._version = 0
        self._lock = threading.Lock()
        self._executor: WorkflowExecutor | None = None
        self._updates: concurrent.futures.ThreadPoolExecutor | None = None
        self._initialized = False
        self.logger = areal_logging.getLogger("FabricInferenceEngine")

    def initialize(
        self,
        engine_id: str | None = None,
        addr: str | list[str] | None = None,
        train_data_parallel_size: int | None = None,
    ) -> None:
        """Connect to the workers at ``addr`` (ZeroMQ addresses or ``host:port``; default
        ``$AREAL_LLM_SERVER_ADDRS``, comma-separated), wait until each answers (up to
        ``config.setup_timeout``) and start AReaL's workflow executor."""
        self.engine_id = engine_id or uuid.uuid4().hex
        self.logger = areal_logging.getLogger(f"[FabricInferenceEngine {self.engine_id}]")
        if addr:
            addresses = addr if isinstance(addr, list) else [addr]
        else:
            addresses = [a for a in os.getenv("AREAL_LLM_SERVER_ADDRS", "").split(",") if a]
        if not addresses:
            raise RuntimeError(
                "No configured fastio workers. Pass their addresses to initialize(addr=...) "
                "or set AREAL_LLM_SERVER_ADDRS."
            )
        # AReaL passes servers as host:port; the fabric takes ZeroMQ addresses.
        self.addresses = [a if "://" in a else f"tcp://{a}" for a in addresses]
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
        self._executor = WorkflowExecutor(config=self.config, inference_engine=self)
        self._executor.initialize(
            logger=self.logger, train_data_parallel_size=train_data_parallel_size
        )
        self._initialized = True

    def destroy(self) -> None:
        """Stop the executor, close the clients and the controller."""
        self._initialized = False
        if self._executor is not None:
            self._executor.destroy()
            self._executor = None
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

    @property
    def initialized(self) -> bool:
        return self._initialized

    @property
    def workflow_executor(self) -> WorkflowExecutor:
        """AReaL's executor that runs this engine's workflows."""
        if self._executor is None:
            raise RuntimeError("WorkflowExecutor is not initialized")
        return self._executor

    def _ctl(self) -> FabricController:
        return _ready(self.controller)

    def _submit(
        self, fn: Callable[..., Any], *args: Any, **kw: Any
    ) -> concurrent.futures.Future[None]:
        return _ready(self._updates).submit(fn, *args, **kw)

    async def agenerate(self, req: Any) -> Any:
        """AReaL's ``ModelResponse`` for its ``ModelRequest``, from some worker, on any
        event loop in any thread (through that loop's client); cancelling the awaiting
        task cancels the request on its worker."""
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

    def set_version(self, version: int) -> None:
        """Set the version the executor's staleness control counts from."""
        with self._lock:
            self._version = version

    def get_version(self) -> int:
        with self._lock:
            return self._version

    def _expected(self, meta: Any) -> int:
        if meta.version is not None:
            return int(meta.version)
        # No version in the meta: any version newer than every worker reports now.
        statuses = self._ctl().health(strict=True)
        return max(s.version for s in statuses.values()) + 1

    def update_weights_from_disk(self, meta: Any) -> concurrent.futures.Future[None]:
        """Wait until every worker loaded ``meta.version`` from fastio's disk route (the
        trainer's :func:`transport.areal.save_for_rollout`; may be called before it)."""
        disk_root(meta)  # a clear error now for a meta that is not a disk one
        return self._submit(self._await_version, self._ctl(), self._expected(meta), "disk")

    def init_weights_update_group(
        self, meta: Any, xccl_group_ranks: list[int] | None = None
    ) -> concurrent.futures.Future[None]:
        """Nothing to set up (each worker's subscriber connected to the trainer's
        publisher when it started): the future checks that every worker answers."""
        return self._submit(self._ctl().request, "health", strict=True)

    def update_weights_from_distributed(
        self, meta: Any, param_specs: list[Any]
    ) -> concurrent.futures.Future[None]:
        """Wait until every worker applied ``meta.version``, published by the trainer's
        :class:`~transport.weights.WeightPublisher` (``param_specs``: not needed)."""
        return self._submit(self._await_version, self._ctl(), self._expected(meta), "publisher")

    def _await_version(self, ctl: FabricController, version: int, route: str) -> None:
        seen = wait_for_version(ctl, version, self.weights_timeout)
        self.logger.info("version %d on every worker via the %s route: %s", version, route, seen)

    def pause_generation(self) -> None:
        """Pause every worker; returns once none generates (interrupted requests are
        re-submitted by their clients and wait until :meth:`continue_generation`)."""
        self._ctl().pause()

    def continue_generation(self) -> None:
        """Resume every worker (waiting and interrupted requests go on)."""
        self._ctl().resume()

    def pause(self) -> None:
        """Pause the executor's submission of new rollouts (AReaL's ``pause``)."""
        self.workflow_executor.pause()

    def resume(self) -> None:
        self.workflow_executor.resume()

    def _resolve_workflow(
        self, workflow: Any, workflow_kwargs: dict[str, Any] | None, group_size: int
    ) -> Any:
        # The RolloutWorkflow cases of AReaL's RemoteInfEngine._resolve_workflow; agent
        # workflows need AReaL's OpenAI proxy over HTTP, which the fabric does not serve.
        if isinstance(workflow, str):
            try:
                workflow = import_from_string(workflow)
            except (ValueError, ImportError, AttributeError) as exc:
                raise ValueError(f"Failed to import workflow from string: {exc}") from exc
        if isinstance(workflow, RolloutWorkflow):
            resolved = workflow
        elif isinstance(workflow, type) and issubclass(workflow, RolloutWorkflow):
            if workflow_kwargs is None:
                raise ValueError(
                    f"workflow_kwargs is required when workflow is a class ({workflow})"
                )
            resolved = workflow(**workflow_kwargs)
        else:
            raise ValueError(
                f"{workflow!r} is not a RolloutWorkflow: agent workflows need AReaL's "
                "OpenAI proxy, which FabricInferenceEngine does not serve"
            )
        if group_size > 1:
            resolved = GroupedRolloutWorkflow(resolved, group_size, self.logger)
        return resolved

    @staticmethod
    def _resolve_accept(fn: Callable[[dict[str, Any]], bool] | str | None) -> Any:
        if isinstance(fn, str):
            fn = import_from_string(fn)
        if fn is not None and not callable(fn):
            raise TypeError(f"should_accept_fn {fn!r} is not callable")
        return fn

    def submit(
        self,
        data: dict[str, Any],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable[[dict[str, Any]], bool] | str | None = None,
        group_size: int = 1,
        task_id: int | None = None,
        is_eval: bool = False,
        **_: Any,
    ) -> int:
        """AReaL's ``submit``: the executor runs the workflow with this engine."""
        return int(
            self.workflow_executor.submit(
                data,
                workflow=self._resolve_workflow(workflow, workflow_kwargs, group_size),
                should_accept_fn=self._resolve_accept(should_accept_fn),
                task_id=task_id,
                is_eval=is_eval,
            )
        )

    def wait(
        self, count: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> list[dict[str, Any] | None]:
        """AReaL's ``wait``: ``count`` accepted results of the executor."""
        ex = self.workflow_executor
        return ex.wait(count, timeout=timeout, raise_timeout=raise_timeout)  # type: ignore[no-any-return]

    def wait_for_task(
        self, task_id: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> dict[str, Any] | None:
        """AReaL's ``wait_for_task``: the result of one submitted task."""
        ex = self.workflow_executor
        return ex.wait_for_task(task_id, timeout, raise_timeout)  # type: ignore[no-any-return]

    def rollout_batch(
        self,
        data: list[dict[str, Any]],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        group_size: int = 1,
    ) -> list[dict[str, Any]]:
        """AReaL's ``rollout_batch``: submit every item, wait for all."""
        workflow = self._resolve_workflow(workflow, workflow_kwargs, group_size)
        return self.workflow_executor.rollout_batch(data=data, workflow=workflow)  # type: ignore[no-any-return]

    def prepare_batch(
        self,
        dataloader: Any,
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable[[dict[str, Any]], bool] | str | None = None,
        group_size: int = 1,
        dynamic_bs: bool = False,
    ) -> list[dict[str, Any]]:
        """AReaL's ``prepare_batch`` (staleness-controlled asynchronous rollout)."""
        return self.workflow_executor.prepare_batch(  # type: ignore[no-any-return]
            dataloader=dataloader,
            workflow=self._resolve_workflow(workflow, workflow_kwargs, group_size),
            should_accept_fn=self._resolve_accept(should_accept_fn),
            dynamic_bs=dynamic_bs,
        )

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
