"""The demo's trainer process: optimizer steps, weight updates that go on when a worker
dies, and the end-of-run weight check over the workers alive then."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from transport.demo.children import StopSignals
from transport.demo.config import REFERENCE_SIZES, DemoConfig
from transport.demo.reports import FinalCheck, ReportSender, UpdateReport
from transport.demo.roles import curve_for_client

__all__ = ["trainer_model", "trainer_role"]

#: Seconds for the workers to apply a version (the publisher sees a dead worker's
#: process end within a heartbeat: it is not waited for this long).
UPDATE_TIMEOUT = 20.0
#: Seconds for the pause and the resume. A worker killed just before its pause is
#: waited for this long while the others stand paused: kept short, yet ample for a
#: worker to stop its step (the pause is answered between two steps).
CONTROL_TIMEOUT = 6.0
#: Seconds the final check waits for every worker to be alive and caught up (spent in
#: full only when a worker is down for good).
CATCH_UP_TIMEOUT = 20.0


def trainer_model(c: DemoConfig) -> tuple[Any, int, Any]:
    """The trainer's copy of the workers' model, its vocabulary and a loss function."""
    import torch

    if c.engine == "reference":
        from transport.engine import TinyLM

        vocab, hidden, layers = REFERENCE_SIZES[c.model_size]
        tiny = TinyLM(vocab, hidden, layers, seed=c.seed)

        def tiny_logits(x: torch.Tensor) -> torch.Tensor:
            return tiny(x)[0]  # type: ignore[no-any-return]

        return tiny, vocab, tiny_logits
    from transport import hf_engine

    if c.model_path:
        model: Any = hf_engine.load_pretrained(c.model_path)
    else:
        model = hf_engine.build_model(c.model_size, seed=c.seed)

    def hf_logits(x: torch.Tensor) -> torch.Tensor:
        return model(input_ids=x).logits  # type: ignore[no-any-return]

    return model, int(model.config.vocab_size), hf_logits


def _alive(c: DemoConfig, pub: Any) -> dict[str, Any]:
    """Worker address -> what the publisher knows of its subscriber, for each worker
    whose subscriber is alive. The publisher sees a same-host worker's process end
    within a heartbeat, so a dead worker is never waited for."""
    infos = pub.workers()
    out = {}
    for i, address in enumerate(c.addresses):
        # The demo starts worker i with --worker-id worker{i} at the i-th address.
        info = infos.get(f"worker{i}")
        if info is not None and info.alive:
            out[address] = info
    return out


class _ShortControl:
    """The controller :func:`update_weights` drives, with :data:`CONTROL_TIMEOUT` for
    pause and resume instead of the update's own timeout."""

    def __init__(self, ctl: Any) -> None:
        self.ctl = ctl

    def pause(self, timeout: float | None = None, *, strict: bool = True) -> Any:
        return self.ctl.pause(CONTROL_TIMEOUT, strict=strict)

    def resume(self, timeout: float | None = None, *, strict: bool = True) -> Any:
        return self.ctl.resume(CONTROL_TIMEOUT, strict=strict)


def _update(c: DemoConfig, ctl: Any, pub: Any, model: Any, version: int) -> UpdateReport:
    """One update over the workers alive now; a worker that dies during it is reported
    lost, not failed (the run promised nothing for a dead worker)."""
    from transport.weights import update_weights

    t0 = time.perf_counter()
    before = _alive(c, pub)
    skipped = [f"worker{i}" for i, w in enumerate(c.addresses) if w not in before]
    if not before:
        # Nobody to pause or wait for; published all the same, so that a worker
        # that comes back catches up to the trainer's weights.
        pub.publish(model, version)
        return UpdateReport(version=version, seconds=time.perf_counter() - t0, skipped=skipped)
    for address in ctl.addresses:
        if address not in before:
            ctl.remove_worker(address)
    for address in before:
        ctl.add_worker(address)
    res = update_weights(
        _ShortControl(ctl), pub, model, version, timeout=UPDATE_TIMEOUT, strict=False
    )
    problems = {**res.failed, **dict.fromkeys(res.missing, "no answer"), **res.resume_failed}
    lost = []
    if problems:
        after = _alive(c, pub)
        for address, info in before.items():
            now = after.get(address)
            if now is None or (now.pid, now.hello_start_time) != (info.pid, info.hello_start_time):
                lost.append(info.worker_id)
                problems.pop(address, None)
                problems.pop(info.worker_id, None)
    return UpdateReport(
        version=version,
        seconds=time.perf_counter() - t0,
        ok=not problems,
        failed=problems,
        skipped=skipped,
        lost=lost,
    )


def _final_check(c: DemoConfig, pub: Any, model: Any, version: int) -> FinalCheck:
    """Every worker alive at the end holds the trainer's weights. The demo process
    waits for a restarting worker before it stops the trainer, so each worker not down
    for good is given :data:`CATCH_UP_TIMEOUT` to say Hello and catch up."""
    from transport.weights import state_digest

    want = state_digest(model.state_dict())
    deadline = time.monotonic() + CATCH_UP_TIMEOUT
    while True:
        live = _alive(c, pub)
        digests = {
            info.worker_id: info.digest if info.version == version else None
            for info in live.values()
        }
        equal = bool(live) and all(d == want for d in digests.values())
        if (equal and len(live) == len(c.addresses)) or time.monotonic() > deadline:
            break
        time.sleep(0.25)  # polling the publisher's view, with a deadline
    return FinalCheck(
        version=version,
        trainer_digest=f"{want:016x}",
        workers={w: f"{d:016x}" if d is not None else "behind" for w, d in digests.items()},
        equal=equal,
        down=[f"worker{i}" for i, w in enumerate(c.addresses) if w not in live],
    )


def trainer_role(c: DemoConfig) -> None:
    import torch

    from transport import FabricController
    from transport.weights import WeightPublisher

    stop = StopSignals()
    torch.manual_seed(1234)
    model, vocab, logits_of = trainer_model(c)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    reports = ReportSender(c.report)
    ctl = FabricController(c.addresses, curve=curve_for_client(c.keys), timeout=UPDATE_TIMEOUT)
    pub_curve = None
    if c.keys:
        from transport import CurveConfig

        pub_curve = CurveConfig(
            secret_key_file=os.path.join(c.keys, "trainer.key_secret"),
            authorized_clients_dir=os.path.join(c.keys, "workers"),
        )
    pub = WeightPublisher(c.publisher, curve=pub_curve)
    print(json.dumps({"ready": pub.endpoint}), flush=True)
    # Wait for every worker's subscriber, but stay responsive to a stop meanwhile.
    joined_by = time.monotonic() + 120
    while not stop.seen:
        try:
            pub.wait_for_workers(len(c.addresses), timeout=0.25)
            break
        except TimeoutError:
            if time.monotonic() > joined_by:
                raise
    version = 0
    next_update = time.monotonic() + c.update_every
    while not stop.seen:
        while not stop.seen and time.monotonic() < next_update:
            time.sleep(min(0.05, max(0.0, next_update - time.monotonic())))
        if stop.seen:
            break
        # A real optimizer step on a small synthetic next-token batch: the weights
        # really change, and the step stays cheap next to the workers' generation.
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
        next_update = time.monotonic() + c.update_every
    reports.send(_final_check(c, pub, model, version))
    ctl.close()
    pub.close()
    reports.close()
