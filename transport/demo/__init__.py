"""The whole system on one machine, in one command: ``python -m transport.demo``.

Real processes over real ZeroMQ sockets: ``--workers`` generation workers
(``python -m transport.worker``, a transformers causal LM or ``--engine reference``, each
with a weight subscriber), one trainer that takes optimizer steps and every
``--update-every`` seconds updates every worker's weights
(:func:`transport.weights.update_weights`), and ``--clients`` rollout clients keeping
``--concurrency`` requests in flight. Children report over PUSH/PULL (msgspec, no
pickle); a live table (or progress lines without a terminal) and a summary show
throughput, latencies, updates, interrupts, re-sends and worker deaths.

A worker that dies (``kill -9``, or ``--chaos`` at 40% of ``--duration``) is restarted
on its address; its clients re-send what it held and it catches up to the trainer's
version. The exit status is 0 only if every request was answered exactly once, every
update reached each worker up through it, and the workers alive at the end hold the
trainer's weights; a worker failing by itself, a client or the trainer ending early fail
the run. Children die with this process even if it is killed: each watches a pipe (its
stdin) whose only writer is this process (no ``preexec_fn``: unsafe in a threaded
parent).
"""

from __future__ import annotations

from transport.demo.children import hf_worker_args
from transport.demo.cli import main
from transport.demo.config import REFERENCE_SIZES, SIZES, DemoConfig
from transport.demo.reports import ClientReport, FinalCheck, UpdateReport

__all__ = [
    "REFERENCE_SIZES",
    "SIZES",
    "ClientReport",
    "DemoConfig",
    "FinalCheck",
    "UpdateReport",
    "hf_worker_args",
    "main",
]
