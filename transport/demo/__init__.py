"""The whole system on one machine, in one command: ``python -m transport.demo``.

Processes (all real, all talking over real ZeroMQ sockets):

* ``--workers`` generation workers (``python -m transport.worker``) serving a
  transformers causal LM (:mod:`transport.hf_engine`, random weights of
  ``--model-size``, or ``--model-path``; ``--engine reference`` serves the tiny GRU of
  :mod:`transport.engine` instead), each with a weight subscriber in its process;
* one trainer: it takes real optimizer steps on its copy of the model and every
  ``--update-every`` seconds pauses generation, publishes the new weights, waits for
  every worker to apply them and resumes (:func:`transport.weights.update_weights`);
* ``--clients`` rollout client processes, each keeping ``--concurrency`` requests in
  flight through a :class:`~transport.FabricClient`.

Children report to this process over a PUSH/PULL socket (msgspec-encoded reports, no
pickle). A live display (on a terminal; otherwise a progress line every few seconds)
shows progress; at the end a summary table gives requests/s, tokens/s, latency
percentiles, ttft and itl, weight-update latency per version, interrupted-and-resumed
counts, re-sends, workers declared dead, lost and restarted, and whether the weights of
the workers alive at the end equal the trainer's.

A worker that dies (``kill -9`` by hand, or ``--chaos``, which SIGKILLs one at 40% of
``--duration``) is reported and started again on its address: its clients re-send what
it held to the other workers, the trainer updates the workers alive meanwhile, and the
restarted worker catches up to the trainer's version. The exit status is 0 only if
every request was answered exactly once (none failed; the ones still in flight at the
stop are counted apart), every update reached each worker up through it, and the
weights of the workers alive at the end equal the trainer's. A worker that fails by
itself (a nonzero exit status, not a signal), a client or the trainer ending early
fail the run.

Ctrl-C (or the end of ``--duration``) shuts everything down in order. Children die with
this process even if it is killed: each holds the read end of a pipe (its stdin) whose
only writer is this process, and a watchdog thread in the child ends it when that pipe
reports end-of-file. (No ``preexec_fn``: it is unsafe in a parent that already runs
threads, as this one does with ZeroMQ's.)
"""

from __future__ import annotations

from transport.demo.children import hf_worker_args
from transport.demo.cli import main
from transport.demo.reports import ClientReport, FinalCheck, UpdateReport
from transport.demo.sizes import REFERENCE_SIZES, SIZES

__all__ = [
    "REFERENCE_SIZES",
    "SIZES",
    "ClientReport",
    "FinalCheck",
    "UpdateReport",
    "hf_worker_args",
    "main",
]
