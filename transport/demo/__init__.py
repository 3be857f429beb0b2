"""The whole system on one machine, in one command: ``python -m transport.demo``
(workers, a trainer, rollout clients; what it checks: ``docs/concepts.md#the-demo``)."""

from __future__ import annotations

from transport.demo.cli import hf_worker_args, main
from transport.demo.config import REFERENCE_SIZES, SIZES, DemoConfig
from transport.demo.reports import ClientReport, FinalCheck, UpdateReport

__all__ = ["REFERENCE_SIZES", "SIZES", "ClientReport", "DemoConfig", "FinalCheck",
           "UpdateReport", "hf_worker_args", "main"]  # fmt: skip
