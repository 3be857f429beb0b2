"""The one-command demo: whole system runs, weights end equal, Ctrl-C leaves nothing."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _demo(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "transport.demo", "--model-size", "tiny", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )


def _run_dir(output: str) -> str:
    m = re.search(r"logs in\s+(/\S+)", output.replace("\n", " "))
    assert m, output
    return m.group(1)


def _wait_for_run_dir(p: subprocess.Popen[str], timeout: float) -> str:
    """Read the demo's output (never blocking past ``timeout``) until it names its run
    directory."""
    assert p.stdout is not None
    fd = p.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        seen += chunk
        m = re.search(r"logs in\s+(/\S+)\s", seen.decode(errors="replace"))
        if m:
            return m.group(1)
    raise AssertionError(f"the demo did not start within {timeout} s: {seen!r}")


def _children_of(run_dir: str) -> list[int]:
    """Live processes whose environment marks them as this demo run's children."""
    found = []
    marker = f"FASTIO_DEMO_RUN={run_dir}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    with open(f"/proc/{pid}/stat") as s:
                        if s.read().split(")")[-1].split()[0] != "Z":
                            found.append(int(pid))
        except OSError:
            continue
    return found


def _wait_children(run_dir: str, n: int, timeout: float) -> list[int]:
    """The demo's processes once at least ``n`` are up (or what is up at the deadline)."""
    deadline = time.monotonic() + timeout
    up = _children_of(run_dir)
    while len(up) < n and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition with a deadline, not synchronising
        up = _children_of(run_dir)
    return up


def _wait_gone(run_dir: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    left = _children_of(run_dir)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition with a deadline, not synchronising
        left = _children_of(run_dir)
    return left


@pytest.mark.parametrize("extra", [[], ["--auth", "--transport", "ipc"]], ids=["tcp", "ipc-curve"])
def test_demo_runs_updates_weights_and_ends_consistent(extra: list[str]) -> None:
    p = _demo("--duration", "6", "--update-every", "1.5", "--workers", "2", "--clients", "1",
              "--concurrency", "8", "--max-new-tokens", "32", *extra)  # fmt: skip
    try:
        out, _ = p.communicate(timeout=150)
    finally:
        p.kill()
    assert p.returncode == 0, out
    assert re.search(r"workers' weights == trainer's\s*│\s*yes", out), out
    done = int(re.search(r"requests done / failed\s*│\s*(\d+) / 0", out).group(1))  # type: ignore[union-attr]
    assert done > 0, out
    version = int(re.search(r"weight version\s*│\s*(\d+)", out).group(1))  # type: ignore[union-attr]
    assert version >= 1, out
    assert _wait_gone(_run_dir(out), 10) == []


@pytest.mark.parametrize("transport", ["ipc"])
def test_ctrl_c_stops_every_process(transport: str) -> None:
    p = _demo("--duration", "120", "--transport", transport, "--clients", "1",
              "--concurrency", "4", "--update-every", "1")  # fmt: skip
    try:
        run_dir = _wait_for_run_dir(p, 90)
        # Wait until the children are up (2 workers, the trainer, 1 client).
        assert len(_wait_children(run_dir, 4, 90)) >= 4
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=90)
    finally:
        p.kill()
    assert "summary" in out, out
    assert _wait_gone(run_dir, 10) == []


def test_killed_orchestrator_takes_children_along() -> None:
    p = _demo("--duration", "120", "--clients", "1", "--concurrency", "2")
    try:
        run_dir = _wait_for_run_dir(p, 90)
        assert len(_wait_children(run_dir, 4, 90)) >= 4
    finally:
        p.kill()  # SIGKILL: no chance to clean up; PR_SET_PDEATHSIG must do it
        p.wait()
    assert _wait_gone(run_dir, 15) == []
