"""What importing a room of fastio / transport loads: the base install (no torch) is
enough for a rollout client, a light module stays light, and no module imports back
into itself (no import circles)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Installed first in a subprocess: every ``import torch`` fails there as it does in an
# environment without torch (the base install).
_NO_TORCH = textwrap.dedent(
    """
    import importlib.abc, sys

    class _NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoTorch())
    """
)


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))\n"
    out = _run(code)
    assert out.returncode == 0, out.stderr
    loaded: list[str] = json.loads(out.stdout.splitlines()[-1])
    return loaded


def test_bucket_loads_neither_client_nor_worker_nor_torch() -> None:
    loaded = _loaded_after("import transport.weights.bucket")
    heavy = [
        m
        for m in loaded
        if m == "torch" or m.startswith(("transport.client", "transport.worker", "torch."))
    ]
    assert heavy == []


def test_weights_modules_import_no_client_and_no_worker() -> None:
    names = sorted(
        f"transport.weights.{p.stem}"
        for p in (ROOT / "transport" / "weights").glob("*.py")
        if p.stem != "__init__"
    )
    loaded = _loaded_after("\n".join(f"import {n}" for n in names))
    assert set(names) <= set(loaded)
    assert [m for m in loaded if m.startswith(("transport.client", "transport.worker"))] == []


def test_package_inits_are_light() -> None:
    """``import transport`` (or ``transport.weights``) imports no room of its own."""
    loaded = _loaded_after("import transport, transport.weights")
    rooms = [m for m in loaded if m.startswith("transport.") and m != "transport.weights"]
    assert rooms == ["transport.errors"]
    assert "torch" not in loaded


def test_lazy_names_resolve() -> None:
    import transport
    import transport.weights

    for pkg in (transport, transport.weights):
        for name in pkg.__all__:
            assert getattr(pkg, name) is not None, (pkg.__name__, name)
    with pytest.raises(AttributeError):
        _ = transport.no_such_room
    with pytest.raises(AttributeError):
        _ = transport.weights.no_such_name


def _module_graph() -> dict[str, set[str]]:
    """Project module -> project modules it imports anywhere (module level, inside
    functions, under ``TYPE_CHECKING``): each is a dependency a reader follows."""
    files: dict[str, Path] = {}
    for pkg in ("fastio", "transport"):
        for p in (ROOT / pkg).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = p
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                # ``from pkg import sub`` depends on pkg.sub, not on pkg's __init__.
                deps.update(
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                )
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    graph = _module_graph()
    assert "transport.client.calls" in graph["transport.client.scheduling"]  # sanity
    assert _circles(graph) == []


#: The weights' drivers: they run the core on sockets and threads and use the routes.
WEIGHT_DRIVERS = {
    f"transport.weights.{m}"
    for m in ("fetching", "publisher", "serving", "staging", "subscriber", "update")
}


def test_no_route_imports_a_weights_driver() -> None:
    graph = _module_graph()
    routes = {m for m in graph if m.startswith("transport.weights.routes")}
    assert "transport.weights.routes.tcp" in routes  # sanity
    assert {r: sorted(graph[r] & WEIGHT_DRIVERS) for r in routes if graph[r] & WEIGHT_DRIVERS} == {}
    # The core (no I/O) uses neither: the drivers carry bytes and time to it.
    core = {m for m in graph if m.startswith("transport.weights.core")}
    above = WEIGHT_DRIVERS | routes
    assert {c: sorted(graph[c] & above) for c in core if graph[c] & above} == {}


def test_no_module_is_longer_than_500_lines() -> None:
    lengths = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for pkg in ("fastio", "transport")
        for p in (ROOT / pkg).rglob("*.py")
    }
    assert {p: n for p, n in lengths.items() if n > 500} == {}


def test_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


@pytest.mark.slow
def test_rollout_client_runs_without_torch() -> None:
    """Where torch cannot be imported (the base install): the types, the codec, an echo
    worker process, a FabricClient and a FabricController all work, and the rooms that
    need torch say which extra brings it."""
    worker = _NO_TORCH + textwrap.dedent(
        """
        import runpy, sys
        sys.argv = ["transport.worker", "--bind", "tcp://127.0.0.1:0", "--engine", "echo"]
        runpy.run_module("transport.worker", run_name="__main__", alter_sys=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", worker],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        endpoint = json.loads(line)["ready"][0]
        client = _NO_TORCH + textwrap.dedent(
            f"""
            import asyncio, sys
            import fastio, transport
            from transport import FabricClient, FabricController

            req = fastio.LLMRequest(input_ids=[5, 6, 7], rid="r1")
            back = fastio.decode(fastio.encode(req))
            assert back.input_ids == [5, 6, 7] and back.rid == "r1"

            async def main():
                async with FabricClient([{endpoint!r}]) as client:
                    resp = await asyncio.wait_for(client.agenerate(req), 30)
                ctl = FabricController([{endpoint!r}])
                try:
                    health = await ctl.ahealth(timeout=10)
                finally:
                    ctl.close()
                return resp, health

            resp, health = asyncio.run(main())
            print("tokens", resp.output_tokens.tolist())
            print("health", len(health))
            for name in ("transport.engine", "transport.weights.publisher"):
                try:
                    __import__(name)
                except ImportError as exc:
                    print("hint", exc)
            print("torch loaded", any(m == "torch" for m in sys.modules))
            """
        )
        out = _run(client, timeout=90)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert "tokens [5, 6, 7]" in lines
        assert "health 1" in lines
        hints = [ln for ln in lines if ln.startswith("hint")]
        assert len(hints) == 2, lines
        assert "pip install 'fastio[reference]'" in hints[0]
        assert "pip install '.[weights]'" in hints[1]
        assert "torch loaded False" in lines
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_torch_tensor_without_torch_is_a_clear_decode_error() -> None:
    pytest.importorskip("torch")
    import torch

    import fastio

    frames = fastio.encode(fastio.LLMRequest(input_ids=[1], metadata={"t": torch.ones(3)}))
    payload = [bytes(f) for f in frames]
    code = _NO_TORCH + textwrap.dedent(
        f"""
        import fastio
        try:
            fastio.decode({payload!r})
        except fastio.DecodeError as exc:
            print(exc)
        """
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert "torch is not installed" in out.stdout
    assert "pip install 'fastio[torch]'" in out.stdout
