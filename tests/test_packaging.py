"""Packaging: what ``pip install fastio`` ships, its extras, scripts and version."""

from __future__ import annotations

import email
import importlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import fastio

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]

# Optional imports (module -> extra). fastio._optional.require names the extra in its
# ImportError, so these must agree with pyproject.toml.
OPTIONAL = {
    "PIL": ("vlm", "pillow"),
    "rich": ("demo", "rich"),
    "safetensors": ("weights", "safetensors"),
    "xxhash": ("weights", "xxhash"),
    "matplotlib": ("plots", "matplotlib"),
    "prometheus_client": ("metrics", "prometheus-client"),
    "transformers": ("hf", "transformers"),
    "uvloop": ("uvloop", "uvloop"),
}


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in reqs}


def test_core_dependencies_are_what_a_rollout_client_needs() -> None:
    assert _names(PROJECT["dependencies"]) == {"msgspec", "pyzmq", "numpy", "torch"}


def test_each_optional_import_has_its_extra() -> None:
    extras = PROJECT["optional-dependencies"]
    for module, (extra, dist) in OPTIONAL.items():
        assert dist in _names(extras[extra]), (module, extra)
    everything = {e for e, _ in OPTIONAL.values()}
    assert extras["all"] == [f"fastio[{','.join(sorted(everything, key=list(extras).index))}]"]
    # The full test suite needs every extra: the test and dev extras pull them in.
    assert "fastio[all]" in extras["test"]
    assert "fastio[test]" in extras["dev"]


def test_ships_fastio_and_transport_only() -> None:
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    assert sorted(find["include"]) == ["fastio", "fastio.*", "transport", "transport.*"]


def test_one_version_source() -> None:
    assert "version" not in PROJECT
    assert "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fastio.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)?", fastio.__version__)


def test_requires_python_is_what_ci_tests() -> None:
    assert PROJECT["requires-python"] == ">=3.11"
    assert "Programming Language :: Python :: 3.11" in PROJECT["classifiers"]
    assert sys.version_info >= (3, 11)


@pytest.mark.parametrize("script", ["fastio-worker", "fastio-demo"])
def test_console_scripts_point_at_a_main(script: str) -> None:
    module, func = PROJECT["scripts"][script].split(":")
    assert callable(getattr(importlib.import_module(module), func))


def test_rollout_client_imports_no_optional_dependency() -> None:
    """``import fastio, transport`` and a client pull in neither the extras nor torch
    (prometheus-client is used when installed: the metrics count then)."""
    heavy = [m for m in OPTIONAL if m != "prometheus_client"] + ["torch"]
    code = (
        "import sys, fastio, transport\n"
        "from transport import ClientConfig, FabricClient, FabricController, SyncFabricClient\n"
        "import transport.metrics\n"
        "fastio.decode(fastio.encode(fastio.LLMRequest(input_ids=[1, 2, 3])))\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_wheel_installs_without_bench(tmp_path: Path) -> None:
    """Build the wheel from a copy of the tree, install it into a target directory and
    import from a directory that is not the checkout: fastio and transport import from
    the install, ``bench`` does not exist, and the metadata carries the one version."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pkg in ("fastio", "transport", "bench", "tests"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=ignore)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = [
        *pip,
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(tmp_path / "dist"),
        str(src),
    ]
    subprocess.run(build, check=True, timeout=300, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("fastio-*.whl")

    with zipfile.ZipFile(wheel) as z:
        tops = {n.split("/", 1)[0] for n in z.namelist()}
        meta = email.message_from_bytes(z.read(f"fastio-{fastio.__version__}.dist-info/METADATA"))
        entry_points = z.read(f"fastio-{fastio.__version__}.dist-info/entry_points.txt").decode()
    assert tops == {"fastio", "transport", f"fastio-{fastio.__version__}.dist-info"}
    assert meta["Version"] == fastio.__version__
    assert meta["Requires-Python"] == ">=3.11"
    assert "fastio-worker = transport.worker:main" in entry_points
    assert "fastio-demo = transport.demo:main" in entry_points

    target = tmp_path / "site"
    install = [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)]
    subprocess.run(install, check=True, timeout=300, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    check = (
        "import fastio, transport, transport.weights, sys\n"
        "print(fastio.__file__); print(transport.__file__)\n"
        "try:\n    import bench\nexcept ModuleNotFoundError:\n    print('no bench')\n"
        "else:\n    print('bench at', bench.__file__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", check],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(str(target)) and lines[1].startswith(str(target)), lines
    assert lines[2] == "no bench"
    assert (target / "fastio" / "py.typed").exists()


def _readme_command(after: str) -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(re.escape(after) + r"\s*```\n(.*?)\n```", text, re.S)
    assert block, f"README has no command block after {after!r}"
    return block.group(1).strip()


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    assert _readme_command("Run the tests:") in (ROOT / ".ci" / "run").read_text()


def test_quickstart_installs_what_the_demo_needs() -> None:
    cmd = _readme_command("for 30 seconds:")
    extras = re.search(r"-e '\.\[([a-z,]+)\]'", cmd)
    assert extras, cmd
    wanted = set(extras.group(1).split(","))
    assert wanted == {"all"} or {"demo", "weights"} <= wanted, cmd
