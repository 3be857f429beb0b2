"""The whole system on one machine, in one command: ``python -m transport.demo``.

Real processes over real ZeroMQ sockets: ``--workers`` generation workers, one trainer
that updates their weights every ``--update-every`` seconds, ``--clients`` rollout
clients keeping ``--concurrency`` requests in flight; a live table (or progress lines)
and a summary. A worker that dies (``kill -9``, ``--chaos``) is restarted on its address
and catches up. The exit status is 0 only if every request was answered exactly once,
every update reached each worker up through it, and the workers alive at the end hold
the trainer's weights. Children die with this process: each watches a pipe (its stdin)
whose only writer is this process (no ``preexec_fn``: unsafe in a threaded parent).
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
