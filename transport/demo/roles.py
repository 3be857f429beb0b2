"""The demo's child roles: a rollout client process, and the trainer process (optimizer
steps, weight updates that go on when a worker dies, the end-of-run weight check)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

from transport.demo.config import REFERENCE_SIZES, DemoConfig
from transport.demo.reports import ClientReport, FinalCheck, ReportSender, UpdateReport

__all__ = ["client_role", "stop_signals", "trainer_model", "trainer_role", "watch_parent"]

#: Seconds for the workers to apply a version (a dead one is seen within a heartbeat).
UPDATE_TIMEOUT = 20.0
#: Seconds for the pause and the resume (the others stand paused while a worker killed
#: just before its pause is waited for).
CONTROL_TIMEOUT = 6.0
#: Seconds the final check waits for every worker to be alive and caught up.
CATCH_UP_TIMEOUT = 20.0


def watch_parent(grace: float = 10.0) -> None:
    """In a child: SIGTERM this process when the demo process is gone, SIGKILL ``grace``
    seconds later. Its stdin is a pipe whose only writer is the demo process (which never
    writes): a read returns end-of-file exactly when that process exits, however it does."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)  # the orderly stop's allowance
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def stop_signals() -> threading.Event:
    """An event set by SIGINT or SIGTERM (a blocking role looks at it between steps)."""
    stop = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.set())
    return stop


#: Role -> the files of its CurveConfig, in the run's keys directory.
_CURVE_FILES = {
    "client": {"secret_key_file": "client.key_secret", "server_public_key_file": "worker.key"},
    "trainer": {"secret_key_file": "trainer.key_secret", "authorized_clients_dir": "workers"},
}


def _curve(keys: str | None, role: str) -> Any:
    """The CurveConfig of ``role`` (None without ``--auth``)."""
    if not keys:
        return None
    from transport import CurveConfig

    return CurveConfig(**{k: os.path.join(keys, v) for k, v in _CURVE_FILES[role].items()})


async def client_role(c: DemoConfig) -> None:
    """A rollout client process: ``concurrency`` request loops, a report every 0.5 s."""
    from fastio import GenerationHyperparameters, LLMRequest, TokenArray
    from transport import ClientConfig, FabricClient

    stop, reports, rep = stop_signals(), ReportSender(c.report), ClientReport(client=c.index)
    rng = random.Random(c.index)
    # Failover within about two seconds of a worker's death, while the run still watches.
    config = ClientConfig(
        curve=_curve(c.keys, "client"), heartbeat_interval=0.5, heartbeat_liveness=4
    )
    print(json.dumps({"ready": True}), flush=True)

    async with FabricClient(c.addresses, config) as client:

        async def one_loop() -> None:
            while not stop.is_set():
                n = rng.randint(8, c.prompt_len)
                req = LLMRequest(
                    input_ids=TokenArray([rng.randrange(c.vocab) for _ in range(n)], "int32"),
                    gconfig=GenerationHyperparameters(
                        max_new_tokens=rng.randint(min(8, c.max_new_tokens), c.max_new_tokens),
                        temperature=1.0,
                    ),
                )
                t0 = time.perf_counter()
                rep.sent += 1
                try:
                    resp = await client.agenerate(req, timeout=300)
                except asyncio.CancelledError:
                    rep.unfinished += 1  # cut by the stop: neither answered nor failed
                    raise
                except Exception as exc:
                    rep.failed += 1
                    print(f"request failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                    await asyncio.sleep(1.0)  # with no worker alive it fails at once
                    continue
                rep.done += 1
                rep.tokens += resp.output_len
                rep.latencies.append(time.perf_counter() - t0)
                rep.ttfts.append(resp.ttft)
                if len(resp.itl):
                    rep.itls.append(float(resp.itl.array.mean()))
                rep.multi_version += len(set(resp.output_versions.array.tolist())) > 1

        def counters() -> None:
            stats = client.stats
            rep.interrupted, rep.resent = stats.get("interrupted", 0), stats.get("resent", 0)
            rep.died, rep.stale = stats.get("workers_died", 0), stats.get("stale", 0)

        tasks = [asyncio.ensure_future(one_loop()) for _ in range(c.concurrency)]
        while not stop.is_set():  # its signal handler runs between the loop's steps
            await asyncio.sleep(0.5)
            counters()
            reports.send(rep)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        counters()
    rep.final = True
    reports.send(rep)
    reports.close()


def trainer_model(c: DemoConfig) -> tuple[Any, int, Any]:
    """The trainer's copy of the workers' model, its vocabulary and its logits function."""
    if c.engine == "reference":
        from transport.engine import TinyLM

        vocab, hidden, layers = REFERENCE_SIZES[c.model_size]
        tiny = TinyLM(vocab, hidden, layers, seed=c.seed)
        return tiny, vocab, lambda x: tiny(x)[0]
    from transport import hf_engine

    if c.model_path:
        model: Any = hf_engine.load_pretrained(c.model_path)
    else:
        model = hf_engine.build_model(c.model_size, seed=c.seed)
    return model, int(model.config.vocab_size), lambda x: model(input_ids=x).logits


def _alive(c: DemoConfig, pub: Any) -> dict[str, Any]:
    """Worker address -> the publisher's view of its subscriber, for each one alive."""
    infos = pub.workers()  # by the demo's --worker-id of the i-th address: worker{i}
    ids = {address: infos.get(f"worker{i}") for i, address in enumerate(c.addresses)}
    return {address: info for address, info in ids.items() if info is not None and info.alive}


def _missing(c: DemoConfig, alive: dict[str, Any]) -> list[str]:
    return [f"worker{i}" for i, address in enumerate(c.addresses) if address not in alive]


def _update(c: DemoConfig, ctl: Any, pub: Any, model: Any, version: int) -> UpdateReport:
    """One update over the workers alive now; one that dies during it is reported lost,
    not failed (the run promised nothing for a dead worker)."""
    from transport.weights import update_weights

    t0 = time.perf_counter()
    before = _alive(c, pub)
    skipped = _missing(c, before)
    if not before:
        # Published all the same: a worker that comes back catches up to it.
        pub.publish(model, version)
        return UpdateReport(version=version, seconds=time.perf_counter() - t0, skipped=skipped)
    for address in set(ctl.addresses) - before.keys():
        ctl.remove_worker(address)
    for address in before:
        ctl.add_worker(address)
    # The pause and the resume within CONTROL_TIMEOUT, the apply within UPDATE_TIMEOUT.
    short = SimpleNamespace(
        pause=lambda *_, **kw: ctl.pause(CONTROL_TIMEOUT, **kw),
        resume=lambda *_, **kw: ctl.resume(CONTROL_TIMEOUT, **kw),
    )
    res = update_weights(short, pub, model, version, timeout=UPDATE_TIMEOUT, strict=False)
    problems = {**res.failed, **dict.fromkeys(res.missing, "no answer"), **res.resume_failed}
    lost = []
    if problems:  # a worker gone, or another incarnation, since the update began: lost
        after = _alive(c, pub)
        for address, info in before.items():
            now = after.get(address)
            if now is None or (now.pid, now.hello_start_time) != (info.pid, info.hello_start_time):
                lost.append(info.worker_id)
                problems.pop(address, None)
                problems.pop(info.worker_id, None)
    return UpdateReport(
        version=version, seconds=time.perf_counter() - t0, ok=not problems,
        failed=problems, skipped=skipped, lost=lost,
    )  # fmt: skip


def _final_check(c: DemoConfig, pub: Any, model: Any, version: int) -> FinalCheck:
    """Every worker alive at the end holds the trainer's weights; each one not down for
    good (the demo waits for a restarting one) has :data:`CATCH_UP_TIMEOUT` to catch up."""
    from transport.weights import state_digest

    want = state_digest(model.state_dict())
    deadline = time.monotonic() + CATCH_UP_TIMEOUT
    while True:
        live = _alive(c, pub)
        digests = {i.worker_id: i.digest if i.version == version else None for i in live.values()}
        equal = bool(live) and all(d == want for d in digests.values())
        if (equal and len(live) == len(c.addresses)) or time.monotonic() > deadline:
            break
        time.sleep(0.25)  # polling the publisher's view, with a deadline
    return FinalCheck(
        version=version,
        trainer_digest=f"{want:016x}",
        workers={w: f"{d:016x}" if d is not None else "behind" for w, d in digests.items()},
        equal=equal,
        down=_missing(c, live),
    )


def trainer_role(c: DemoConfig) -> None:
    """The trainer process: a step and an update every ``update_every`` s until stopped.
    Its ready line carries the model's vocabulary size (for the clients' prompts)."""
    import torch

    from transport import FabricController
    from transport.weights import WeightPublisher

    stop = stop_signals()
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    model, vocab, logits_of = trainer_model(c)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    reports = ReportSender(c.report)
    ctl = FabricController(c.addresses, curve=_curve(c.keys, "client"), timeout=UPDATE_TIMEOUT)
    pub = WeightPublisher(c.publisher, curve=_curve(c.keys, "trainer"))
    print(json.dumps({"ready": pub.endpoint, "vocab": vocab}), flush=True)
    joined_by = time.monotonic() + 120  # every worker's subscriber, responsive to a stop
    while len(_alive(c, pub)) < len(c.addresses) and not stop.wait(0.25):
        if time.monotonic() > joined_by:
            raise TimeoutError(f"{len(_alive(c, pub))} of {len(c.addresses)} subscribers joined")
    version = 0
    while not stop.wait(c.update_every):
        # A real step on a small synthetic next-token batch: the weights really change.
        x = torch.randint(0, vocab, (2, 17))
        logits = logits_of(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        version += 1
        rep = _update(c, ctl, pub, model, version)
        rep.loss, rep.nbytes = loss.item(), nbytes
        reports.send(rep)
    reports.send(_final_check(c, pub, model, version))
    ctl.close()
    pub.close()
    reports.close()
