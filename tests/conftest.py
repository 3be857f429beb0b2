"""The fast subset (which tests carry the ``slow`` marker) and how the suite runs in
parallel.

``python -m pytest -m "not slow"`` runs the fast subset (its time on 2 cores is in the README);
``python -m pytest`` runs everything, as CI and the README's test command do.

A test is slow when it takes more than about 2 s on a quiet 2-core machine: it starts
worker processes, kills them on purpose, waits out heartbeat or recovery timeouts, or
runs the whole demo. New tests mark themselves with ``@pytest.mark.slow``. The lists
below mark the tests written before the marker was used, found with
``python -m pytest --durations=0``: a whole module, or a test function with all its
parametrizations. An entry that no longer names a test is reported as a warning, so a
moved test cannot silently join the fast subset.

The suite runs on 4 pytest-xdist workers (``-n 4`` in pyproject.toml; ``-n 0`` runs it
in one process). Most tests wait on processes and sockets rather than on the CPU, so 4
workers fit 2 cores. Slow tests are handed out first so that none of them starts last,
and the modules of ``GROUPS`` run on one worker each, in order: their module-scoped
fixture (a worker process, a model) is built once, and the demo's multi-process runs do
not compete with each other.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Every test of these modules is slow.
SLOW_MODULES = {
    "tests/transport/client/test_asyncio.py": "one worker process serves every asyncio API",
    "tests/transport/test_demo.py": "runs the demo: trainer, workers and clients",
    "tests/transport/worker/test_eager.py": "each fixture starts worker processes (8-10 s)",
    "tests/transport/weights/test_dist.py": "torch.distributed groups across processes",
    "tests/transport/weights/drivers/test_faults.py": "kills publishers/subscribers mid-update",
}

# module -> slow test functions (all parametrizations).
SLOW_TESTS = {
    "tests/fastio/test_codec.py": ["test_cross_process_echo"],
    "tests/fastio/test_properties.py": ["test_round_trip_every_type"],
    "tests/transport/sockets/test_auth.py": ["test_curve_admits_authorized_keys_only"],
    "tests/transport/worker/test_bad_input.py": [
        "test_garbage_to_worker_gets_error_replies_and_others_unaffected",
        "test_handler_error_is_reported",
    ],
    "tests/transport/fabric/test_fabric.py": [
        "test_cancel_and_timeout_abort_on_worker",
        "test_custom_engine_factory_from_the_command_line",
        "test_many_concurrent_requests",
        "test_overloaded_worker_pushes_back_without_loss",
        "test_pause_interrupt_resume_accumulates_versions",
        "test_reference_engine_generates_streams_and_is_deterministic",
        "test_rid_stickiness_and_runtime_membership",
        "test_stalled_worker_is_replaced_then_rejoins",
        "test_sticky_cache_stays_bounded_and_keeps_recent_rids",
        "test_sync_client",
        "test_vlm_request_round_trip",
        "test_worker_cancels_requests_of_a_killed_client",
        "test_worker_restarted_rejoins",
        "test_worker_sigkilled_midflight_requests_resent",
    ],
    "tests/transport/fabric/test_recovery.py": [
        "test_client_stalled_past_client_timeout_gets_its_requests_back",
        "test_connection_reset_keeps_the_client_and_its_answers",
        "test_echo_handler_output_is_consistent",
        "test_error_reply_sent_while_disconnected_is_replayed",
        "test_invalid_handler_output_is_a_handler_error",
        "test_unencodable_request_fails_alone_and_frees_its_slot",
    ],
    "tests/transport/weights/drivers/test_update.py": [
        "test_a_controller_pause_during_a_copy_is_not_undone",
        "test_a_worker_unknown_to_the_publisher_is_missing",
        "test_failed_pause_resumes_the_others",
        "test_no_copy_while_a_generation_still_runs",
    ],
}


# module -> why its tests stay together on one xdist worker.
GROUPS = {
    "tests/transport/test_demo.py": "each run is a trainer, workers and clients at once",
    "tests/transport/client/test_asyncio.py": "one module-scoped worker process",
    "tests/transport/test_wire_compat.py": "one module-scoped echo worker",
    "tests/transport/engines/test_hf_engine.py": "one module-scoped tiny model",
    "tests/transport/areal/test_areal.py": "a module-scoped tokenizer and model",
    "tests/test_metrics.py": "one module-scoped metrics endpoint",
    "tests/test_clear_failures.py": "one module-scoped mount namespace probe",
}


def _where(item: pytest.Item) -> tuple[str, str]:
    path = Path(str(item.path)).resolve()
    try:
        rel = path.relative_to(ROOT).as_posix()
    except ValueError:
        rel = path.as_posix()
    return rel, getattr(item, "originalname", item.name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add the ``slow`` marker to the listed tests (a test's own marker stays as it is)
    and put slow tests first."""
    slow = pytest.mark.slow
    seen: set[tuple[str, str]] = set()
    collected: set[str] = set()
    for item in items:
        module, name = _where(item)
        collected.add(module)
        listed = name in SLOW_TESTS.get(module, ())
        if listed:
            seen.add((module, name))
        if (module in SLOW_MODULES or listed) and item.get_closest_marker("slow") is None:
            item.add_marker(slow)
    # Stable: the order within each part stays the collection order. xdist hands tests out
    # in this order (the GROUPS first, as larger units).
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    stale = [f"{m} (missing)" for m in [*SLOW_MODULES, *SLOW_TESTS] if not (ROOT / m).exists()]
    stale += [
        f"{module}::{name}"
        for module, names in SLOW_TESTS.items()
        if module in collected
        for name in names
        if (module, name) not in seen
    ]
    # Only when whole modules were collected: -k or a node id selects a part of one.
    if stale and not config.option.keyword and all("::" not in a for a in config.args):
        warnings.warn(
            "tests/conftest.py lists slow tests that no longer exist (mark their new "
            "homes with @pytest.mark.slow and drop the entries): " + ", ".join(stale),
            pytest.PytestWarning,
            stacklevel=1,
        )


# tryfirst: xdist's own implementation answers otherwise (the first answer wins).
@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``-n`` and the default ``--dist load``: one scheduling unit per test, except the
    modules of :data:`GROUPS`, one unit each. (The ``xdist_group`` marker would do this, but
    pytest 9 ignores the node id suffix that xdist's ``loadgroup`` relies on.)"""
    if config.getvalue("dist") != "load":
        return None  # an explicit --dist other than load is the caller's choice
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in GROUPS else nodeid

    return GroupScheduling(config, log)
