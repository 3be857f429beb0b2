"""The one-command demo: whole system runs, weights end equal, Ctrl-C leaves nothing."""

from __future__ import annotations

import os
import re
import select
import shutil
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
    """Read the demo's output until it names its run directory."""
    return _run_dir(_read_until(p, r"logs in\s+/\S+\s", timeout))


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


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [[], ["--auth", "--transport", "ipc"]], ids=["tcp", "ipc-curve"])
def test_demo_runs_updates_weights_and_ends_consistent(extra: list[str]) -> None:
    p = _demo("--duration", "6", "--update-every", "1.5", "--workers", "2", "--clients", "1",
              "--concurrency", "8", "--max-new-tokens", "32", *extra)  # fmt: skip
    try:
        out, _ = p.communicate(timeout=250)
    finally:
        p.kill()
    assert p.returncode == 0, out
    assert re.search(r"workers' weights == trainer's\s*│\s*yes", out), out
    done = int(re.search(r"requests done / failed\s*│\s*(\d+) / 0", out).group(1))  # type: ignore[union-attr]
    assert done > 0, out
    version = int(re.search(r"weight version\s*│\s*(\d+)", out).group(1))  # type: ignore[union-attr]
    assert version >= 1, out
    assert _wait_gone(_run_dir(out), 10) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
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
    shutil.rmtree(run_dir, ignore_errors=True)  # kept if nothing completed before Ctrl-C


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_orchestrator_takes_children_along() -> None:
    p = _demo("--duration", "120", "--clients", "1", "--concurrency", "2")
    try:
        run_dir = _wait_for_run_dir(p, 90)
        assert len(_wait_children(run_dir, 4, 90)) >= 4
    finally:
        p.kill()  # SIGKILL: no chance to clean up; the children's watchdogs must do it
        p.wait()
    assert _wait_gone(run_dir, 15) == []
    shutil.rmtree(run_dir, ignore_errors=True)  # the killed demo could not remove it


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_a_tty_it_prints_progress_lines_and_removes_its_directory() -> None:
    p = _demo("--duration", "5", "--progress-every", "1", "--clients", "1",
              "--concurrency", "4", "--update-every", "2")  # fmt: skip
    try:
        out, _ = p.communicate(timeout=250)
    finally:
        p.kill()
    assert p.returncode == 0, out
    progress = re.findall(r"^\[\s*\d+ s\] done \d+", out, re.M)
    assert len(progress) >= 3, out
    run_dir = _run_dir(out)
    assert not os.path.exists(run_dir), "the run's directory was left behind"
    assert "logs kept" not in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_no_completed_request_is_a_failure_and_keeps_the_logs() -> None:
    # Every step sleeps 5 s: no request (8 tokens at least) completes in 2 s.
    p = _demo("--duration", "2", "--token-interval", "5", "--clients", "1",
              "--concurrency", "2", "--update-every", "60")  # fmt: skip
    try:
        out, _ = p.communicate(timeout=250)
    finally:
        p.kill()
    assert p.returncode == 1, out
    assert "no request completed" in out, out
    run_dir = _run_dir(out)
    assert f"logs kept in {run_dir}" in out
    assert os.path.exists(os.path.join(run_dir, "worker0.log"))
    assert _wait_gone(run_dir, 10) == []
    shutil.rmtree(run_dir)


def test_a_failed_update_fails_the_run() -> None:
    from transport.demo.reports import ClientReport, FinalCheck, RunState, UpdateReport, verdict

    st = RunState()
    st.clients[0] = ClientReport(client=0, sent=5, done=5, final=True)
    st.final = FinalCheck(version=2, trainer_digest="0", workers={"w": "0"}, equal=True)
    st.updates = [UpdateReport(version=1, seconds=0.1), UpdateReport(version=2, seconds=0.1)]
    assert verdict(st, early=False) == ""
    st.updates[1].ok = False
    assert "versions [2]" in verdict(st, early=False)
    st.updates[1].ok = True
    st.final.equal = False
    assert "differ" in verdict(st, early=False)
    assert "early" in verdict(st, early=True)


def test_the_verdict_judges_answers_not_deaths() -> None:
    from transport.demo.reports import ClientReport, FinalCheck, RunState, WorkerEvent, verdict

    st = RunState()
    st.clients[0] = ClientReport(client=0, sent=9, done=7, unfinished=2, resent=3, final=True)
    st.final = FinalCheck(1, "0", {"worker0": "0"}, equal=True, down=["worker1"])
    # A worker killed by a signal and left down breaks no promise.
    st.events = [WorkerEvent("worker1", 2.0, "died", "SIGKILL", chaos=True)]
    assert verdict(st, early=False) == ""
    st.crashed = ["worker1 (exit status 1: boom)"]
    assert "worker1" in verdict(st, early=False)
    st.crashed = []
    st.clients[0].failed = 1
    assert "1 request(s) failed" in verdict(st, early=False)
    st.clients[0].failed = 0
    st.clients[0].unfinished = 1  # one request neither answered nor cut
    assert "neither answered" in verdict(st, early=False)
    st.clients[0].unfinished = 2
    st.clients[0].final = False
    assert "final report" in verdict(st, early=False)
    st.clients[0].final = True
    st.final = FinalCheck(1, "0", {}, equal=False, down=["worker0", "worker1"])
    assert "no worker was alive" in verdict(st, early=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "--workers 0: expected an integer >= 1"),
        (["--duration", "-1"], "--duration -1: expected a number > 0"),
        (["--model-path", "/nonexistent/model"], "no config.json"),
        (["--chaos", "--workers", "1"], "--chaos needs --workers 2 or more"),
    ],
)
def test_user_errors_print_one_line(args: list[str], message: str) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "transport.demo", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert p.returncode == 2, p
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_no_preexec_fn_in_the_threaded_parent() -> None:
    # Children die with the demo through a pipe and a watchdog (see
    # test_killed_orchestrator_takes_children_along), not through preexec_fn.
    src = "".join(f.read_text() for f in (ROOT / "transport" / "demo").glob("*.py"))
    assert "subprocess.Popen" in src  # the files that start the children were read
    assert "preexec_fn=" not in src and "prctl" not in src


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_large_model_serves() -> None:
    p = subprocess.Popen(
        [sys.executable, "-m", "transport.demo", "--model-size", "large", "--duration", "20",
         "--update-every", "8"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    try:
        out, _ = p.communicate(timeout=550)
    finally:
        p.kill()
    assert p.returncode == 0, out
    done = int(re.search(r"requests done / failed\s*│\s*(\d+) / 0", out).group(1))  # type: ignore[union-attr]
    assert done > 0, out
    assert re.search(r"workers' weights == trainer's\s*│\s*yes", out), out


def _read_until(p: subprocess.Popen[str], pattern: str, timeout: float) -> str:
    """The demo's output up to a line matching ``pattern`` (never blocking past
    ``timeout``)."""
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
        if re.search(pattern, seen.decode(errors="replace"), re.M):
            return seen.decode(errors="replace")
    raise AssertionError(f"no {pattern!r} within {timeout} s: {seen!r}")


def _worker_pid(run_dir: str, name: str) -> int:
    for pid in _children_of(run_dir):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        if b"transport.worker" in args and name.encode() in args:
            return pid
    raise AssertionError(f"no process of {name} in {run_dir}")


def _row(out: str, name: str) -> str:
    m = re.search(rf"{re.escape(name)}\s*│\s*(.+?)\s*│", out)
    assert m, out
    return m.group(1)


def _assert_survived(out: str, died: str) -> None:
    """The run reports the death and its re-sends, and ends with every request
    answered and the weights equal on both workers (the dead one restarted)."""
    assert re.search(rf"{died} died \(SIGKILL\)", out), out
    assert _row(out, "workers lost / restarted") == "1 / 1", out
    assert re.search(rf"{died} back\s*│\s*at [\d.]+ s: restart 1", out), out
    resent = int(_row(out, "re-sent after worker loss"))
    assert resent >= 0, out  # what the kill caught in flight: reported, whatever it was
    done, failed = map(int, _row(out, "requests done / failed").split(" / "))
    assert done > 0 and failed == 0, out
    assert re.search(r"workers' weights == trainer's\s*│\s*yes \(v\d+, 2 workers alive", out), out
    assert "FAILED" not in out and "exited early" not in out, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_kills_a_worker_and_the_run_survives() -> None:
    p = _demo("--engine", "reference", "--duration", "8", "--update-every", "1", "--workers",
              "2", "--clients", "1", "--concurrency", "8", "--chaos")  # fmt: skip
    try:
        out, _ = p.communicate(timeout=280)
    finally:
        p.kill()
    assert p.returncode == 0, out
    m = re.search(r"chaos: killing (worker\d) \(pid \d+\) with SIGKILL", out)
    assert m, out
    _assert_survived(out, m.group(1))
    assert "(--chaos)" in _row(out, f"{m.group(1)} died"), out
    assert _wait_gone(_run_dir(out), 10) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_killed_from_outside_is_survived() -> None:
    p = _demo("--engine", "reference", "--duration", "10", "--update-every", "1", "--workers",
              "2", "--clients", "1", "--concurrency", "8", "--progress-every", "0.5")  # fmt: skip
    try:
        head = _read_until(p, r"^\[\s*[\d.]+ s\] done [1-9]", 200)
        os.kill(_worker_pid(_run_dir(head), "worker0"), signal.SIGKILL)
        rest, _ = p.communicate(timeout=250)
    finally:
        p.kill()
    out = head + rest
    assert p.returncode == 0, out
    _assert_survived(out, "worker0")
    assert "--chaos" not in out, out
    assert _wait_gone(_run_dir(out), 10) == []


def test_the_progress_line_counts_dead_workers_not_declarations(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from transport.demo.reports import ClientReport, Display, RunState, WorkerEvent

    st = RunState()
    # Two clients each declared the one dead worker.
    st.clients = {i: ClientReport(client=i, done=3, died=1) for i in range(2)}
    st.events = [WorkerEvent("worker1", 2.0, "died", "SIGKILL")]
    with Display(live=False, interval=0.0) as display:
        display.update(st)
    line = capsys.readouterr().out
    assert re.search(r"workers dead 1, restarted 0", line), line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-len", "3"], "--prompt-len 3: expected an integer >= 8"),
        (["--workers", "x"], "--workers x: expected an integer"),
        (["--token-interval", "-1"], "--token-interval -1: expected a number >= 0"),
        (["--update-every", "0"], "--update-every 0: expected a number > 0"),
        (["--engine", "gpu"], "invalid choice: 'gpu'"),
        (["--model-path", "/m", "--engine", "reference"], "--model-path needs --engine hf"),
    ],
)
def test_a_bad_flag_is_named_by_the_config_check(args: list[str], message: str) -> None:
    from transport.demo.config import UserError, parse_config

    with pytest.raises(UserError, match=re.escape(message)):
        parse_config(args)


def test_the_flags_are_the_config_fields() -> None:
    import msgspec

    from transport.demo.config import DemoConfig, parse_config

    role, c = parse_config(["--engine", "reference", "--model-size", "tiny", "--workers", "3",
                            "--chaos", "--duration", "2.5"])  # fmt: skip
    assert role == "orchestrator"
    # The size's defaults fill --concurrency and --update-every; the rest are the fields'.
    want = DemoConfig(engine="reference", model_size="tiny", workers=3, chaos=True,
                      duration=2.5, concurrency=32, update_every=5.0)  # fmt: skip
    assert c == want
    role, child = parse_config(["--role", "client", "--config", msgspec.json.encode(c).decode()])
    assert (role, child) == ("client", c)
