"""``python -m transport.worker`` as a user meets it: one-line errors with exit status 2
(a plugin that fails as it starts: 1), no traceback, defaults in --help, a metrics
endpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable

import pytest

from fastio import LLMRequest
from tests.transport.conftest import ROOT, WorkerProc
from transport import SyncFabricClient


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    pp = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), pp]) if pp else str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "transport.worker", *args],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["--bind", "tcp://127.0.0.1:0", "--engine", "nope"], 2, "choose from reference, echo, hf, sglang, vllm"),
        (["--bind", "tcp://127.0.0.1:0", "--engine", "sglang"], 2, "needs --engine-opt url=http://host:port"),
        (["--bind", "tcp://127.0.0.1:0", "--engine", "vllm", "--engine-opt", "url=http://127.0.0.1:1"], 2, "cannot reach the vLLM server at http://127.0.0.1:1"),
        (["--bind", "tcp://127.0.0.1:0", "--engine", "sglang", "--engine-opt", "url=http://127.0.0.1:1", "--engine-opt", "colour=red"], 2, "unknown option(s) ['colour']"),
        (["--bind", "tcp://127.0.0.1:0", "--engine-opt", "novalue"], 2, "expected key=value"),
        (["--bind", "127.0.0.1:5555", "--engine", "echo"], 2, "bind address '127.0.0.1:5555' has no scheme"),
        (["--bind", "tcp://127.0.0.1:0", "--engine", "no_such_mod:f"], 2, "cannot import"),
        (["--bind", "tcp://127.0.0.1:0", "--engine", "echo", "--engine-opt", "a=1"], 2, "echo"),
        (["--bind", "tcp://127.0.0.1:0", "--engine-opt", "depth=3"], 2, "reference engine takes"),
        (["--bind", "tcp://127.0.0.1:0", "--log-level", "loud"], 2, "--log-level"),
        # WorkerConfig's constraints, named by the flag (a worker with 0 slots would
        # accept requests and never run them).
        (["--bind", "tcp://127.0.0.1:0", "--engine", "echo", "--max-concurrency", "0"], 2, "--max-concurrency 0: expected an integer >= 1"),
        (["--bind", "tcp://127.0.0.1:0", "--engine", "echo", "--client-timeout", "soon"], 2, "--client-timeout soon: expected a number"),
        (
            ["--bind", "tcp://127.0.0.1:0", "--engine", "echo", "--log-level", "info",
             "--plugin", "tests.transport.plugins:failing_plugin", "--plugin-opt", "x=1"],
            1,
            "failed at start: ValueError: bad plugin options ['x']",
        ),
    ],
)  # fmt: skip
def test_user_errors_are_one_line(args: list[str], code: int, words: str) -> None:
    r = run_cli(*args)
    assert r.returncode == code, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("python -m transport.worker: error:")
    assert words in lines[0]
    assert "ready" not in r.stdout  # never reported ready


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["--engine", "echo", "--plugin", "transport.weights.update:subscribe",
          "--plugin-opt", "weights_endpoint=tcp://127.0.0.1:1", "--plugin-opt", "weights_shm=maybe"],
         1, "ValueError: weights plugin option weights_shm='maybe': expected a boolean"),
        (["--engine", "echo", "--plugin", "transport.weights.disk_follow:follow",
          "--plugin-opt", "disk_root=/nonexistent", "--plugin-opt", "disk_dir=/y"],
         1, "ValueError: unknown disk plugin option 'disk_dir'; known: disk_root"),
        (["--engine", "hf", "--engine-opt", "max_batch=many"],
         2, "--engine hf: hf engine option max_batch='many': expected an integer"),
        (["--engine", "echo", "--plugin", "transport.weights.update:nothing"],
         2, "--plugin 'transport.weights.update:nothing': transport.weights.update has no"),
    ],
)  # fmt: skip
def test_bad_plugin_and_engine_options_are_one_line(args: list[str], code: int, words: str) -> None:
    """Options are checked by the plugin's or engine's option Struct
    (:mod:`transport.options`): the line names the key and what it expected."""
    if "hf" in args:
        pytest.importorskip("transformers")
    test_user_errors_are_one_line(["--bind", "tcp://127.0.0.1:0", *args], code, words)


def test_help_shows_engines_and_defaults() -> None:
    r = run_cli("--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "{reference,echo,hf,sglang,vllm,module:factory}" in text
    assert "(default: reference)" in text and "(default: WARNING)" in text
    assert "--engine-opt" in text and "--plugin-opt" in text and "--metrics-port" in text
    assert "--model-size {tiny,small,medium,large}" in text


def test_metrics_endpoint_counts_requests(spawn: Callable[..., WorkerProc]) -> None:
    pytest.importorskip("prometheus_client")
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo", "--metrics-port", "0", wait=False)
    w.wait_ready()
    # The ready line carried the metrics port; read it again from the process's output.
    port = w.ready["metrics"]
    with SyncFabricClient([w.address]) as client:
        for i in range(3):
            client.generate(LLMRequest(input_ids=[i, 1]))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'fastio_worker_requests_total{outcome="ok"} 3.0' in text
    assert "fastio_worker_e2e_seconds_count 3.0" in text
    assert "fastio_worker_in_flight 0.0" in text
