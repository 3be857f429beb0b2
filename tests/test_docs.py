"""Every ```python block of README.md and docs/*.md runs, or says why it cannot.

A block runs as a script in a fresh interpreter (cwd: a temporary directory, the
checkout on ``PYTHONPATH``). The line before its fence may hold one HTML comment that
says what the block needs:

- ``<!-- skip: REASON -->``: not run (a model, a remote host, ...); REASON is required.
- ``<!-- run: workers=ADDR[,ADDR...] [weights=ADDR] -->``: before the block runs,
  reference-engine workers are started (with the weights plugin following ``weights``
  when given), and each ADDR in the block's text is replaced by the address a worker
  actually bound; ``weights`` by a free loopback port.
- ``<!-- run: serve=ADDR -->``: the block is a server that runs until stopped. ADDR is
  replaced by a free loopback port; the test sends it one request with a real client,
  checks the answer, and stops it.

Shell blocks (```bash and bare fences) are not run; their ``python -m transport.worker``
and ``python -m transport.demo`` flags are checked against the commands' ``--help``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w+-]*)\s*$")
MARKER = re.compile(r"^<!--\s*(skip|run):(.*?)-->\s*$")
BLOCK_TIMEOUT = 120.0


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: tuple[str, str] | None  # (kind, argument)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> Iterator[Block]:
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        prev = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        mk = MARKER.match(prev)
        marker = (mk.group(1), mk.group(2).strip()) if mk else None
        yield Block(path, start + 1, lang, "\n".join(lines[start + 1 : j]) + "\n", marker)
        i = j + 1


ALL = [b for p in DOCS for b in _blocks(p)]
PYTHON = [b for b in ALL if b.lang == "python"]
SHELL = [b for b in ALL if b.lang in ("", "bash", "sh", "shell", "console")]


def test_docs_have_python_blocks() -> None:
    # The collection itself can fail (a renamed file, a fence the regex misses).
    assert len(PYTHON) >= 10, [b.id for b in PYTHON]
    assert any(b.path.name == "README.md" for b in PYTHON)


def test_every_marker_is_known_and_every_skip_has_a_reason() -> None:
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip().startswith("<!-- skip") or line.strip().startswith("<!-- run"):
                assert MARKER.match(line.strip()), f"{path.name}:{n}: malformed marker {line!r}"
    for b in PYTHON:
        if b.marker and b.marker[0] == "skip":
            assert len(b.marker[1]) >= 8, f"{b.id}: a skip needs a reason, got {b.marker[1]!r}"


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _env() -> dict[str, str]:
    pp = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), pp]) if pp else str(ROOT))


def _start_workers(n: int, weights: str | None, procs: list[subprocess.Popen[str]]) -> list[str]:
    """Start ``n`` reference workers at once (each imports torch: seconds), add them to
    ``procs`` (the caller stops them) and return their bound addresses."""
    args = [sys.executable, "-m", "transport.worker", "--bind", "tcp://127.0.0.1:0"]
    if weights:
        args += ["--plugin", "transport.weights.update:subscribe"]
        args += ["--plugin-opt", f"weights_endpoint={weights}"]
    mine = [
        subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
        for _ in range(n)
    ]
    procs.extend(mine)
    bound = []
    deadline = time.monotonic() + 60
    for proc in mine:
        assert proc.stdout is not None
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError("worker did not print its ready line")
            if select.select([proc.stdout], [], [], 0.2)[0]:
                bound.append(json.loads(proc.stdout.readline())["ready"][0])
                break
    return bound


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _args(text: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in text.split())


def _is_slow(b: Block) -> bool:
    # Starting processes or importing torch costs more than the fast subset's budget.
    return b.marker is not None or "torch" in b.code or "transport" in b.code


@pytest.mark.timeout(3 * BLOCK_TIMEOUT)  # workers to start, the block, a server's check
@pytest.mark.parametrize(
    "block",
    [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if _is_slow(b) else []) for b in PYTHON],
)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    if block.marker and block.marker[0] == "skip":
        pytest.skip(block.marker[1])
    code, procs = block.code, []
    args = _args(block.marker[1]) if block.marker else {}
    try:
        weights = None
        if "weights" in args:
            weights = _free_address()
            code = code.replace(args["weights"], weights)
        wanted = args["workers"].split(",") if "workers" in args else []
        for addr, bound in zip(wanted, _start_workers(len(wanted), weights, procs), strict=True):
            assert addr in code, f"{block.id}: {addr} is not in the block"
            code = code.replace(addr, bound)
        script = tmp_path / "block.py"
        if "serve" in args:
            addr = _free_address()
            assert args["serve"] in code, f"{block.id}: {args['serve']} is not in the block"
            script.write_text(code.replace(args["serve"], addr))
            _check_server(block, script, addr, tmp_path)
            return
        script.write_text(code)
        out = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT,
        )
        assert out.returncode == 0, f"{block.id} failed:\n{out.stdout}\n{out.stderr}"
    finally:
        for p in procs:
            _stop(p)


def _check_server(block: Block, script: Path, addr: str, tmp_path: Path) -> None:
    from fastio import GenerationHyperparameters, LLMRequest
    from transport import ClientConfig, SyncFabricClient

    log = (tmp_path / "server.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, env=_env(), stdout=log, stderr=log
    )
    try:
        with SyncFabricClient([addr], ClientConfig(connect_timeout=60)) as client:
            req = LLMRequest(
                input_ids=[1, 2, 3], gconfig=GenerationHyperparameters(max_new_tokens=4)
            )
            resp = client.generate(req, timeout=60)
        assert resp.output_len >= 1 and len(resp.output_versions) == resp.output_len
        assert proc.poll() is None, "the server exited"
    except BaseException:
        log.seek(0)
        print(f"{block.id} output:\n{log.read()}")
        raise
    finally:
        _stop(proc)
        log.close()


def test_readme_benchmark_table_lists_every_case() -> None:
    """Every case of the committed quick run is in the README's table, the ones where
    fastio is behind included."""
    results = json.loads((ROOT / "bench" / "results" / "quick" / "results.json").read_text())
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Benchmarks") :]
    table = "\n".join(ln for ln in table.splitlines() if ln.startswith("|"))
    cases = {m["case"].split("@")[0] for m in results["measurements"]}
    missing = sorted(c for c in cases if f"`{c}`" not in table)
    assert not missing, f"README's benchmark table lacks {missing}"
    baselines = {m["impl"] for m in results["measurements"]} - {"fastio"}
    named = {"vllm-style": "vLLM-style", "msgspec-lists": "msgspec lists"}
    named |= {"msgspec-bytes": "msgspec bytes", "raw-pyzmq": "raw pyzmq", "frame": "a frame"}
    named |= {"fastio-1k-tokens": "1k tokens", "fastio-16KiB": "16 KiB"}
    named |= {"fastio-default-gc": "default GC thresholds"}
    absent = sorted(b for b in baselines if named.get(b, b) not in table)
    assert not absent, f"README's benchmark table lacks the baselines {absent}"


@functools.cache
def _help(module: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


COMMANDS = {
    "transport.worker": ("python -m transport.worker", "fastio-worker"),
    "transport.demo": ("python -m transport.demo", "fastio-demo"),
}


def _command_lines() -> list[tuple[str, str, str]]:
    found = []
    for b in SHELL:
        for line in b.code.splitlines():
            for module, spellings in COMMANDS.items():
                if any(s in line for s in spellings):
                    found.append((b.id, module, line))
    return found


@pytest.mark.slow
def test_shell_blocks_use_flags_that_exist() -> None:
    lines = _command_lines()
    assert any(m == "transport.worker" for _, m, _ in lines)
    for where, module, line in lines:
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line):
            if flag == "--help":
                continue
            assert re.search(rf"(?<![\w-]){re.escape(flag)}\b", _help(module)), (
                f"{where}: {module} has no {flag} ({line.strip()})"
            )
