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
    "torch": ("torch", "torch"),
    "PIL": ("vlm", "pillow"),
    "rich": ("demo", "rich"),
    "safetensors": ("weights", "safetensors"),
    "xxhash": ("weights", "xxhash"),
    "matplotlib": ("plots", "matplotlib"),
    "prometheus_client": ("metrics", "prometheus-client"),
    "transformers": ("hf", "transformers"),
    "aiohttp": ("sglang", "aiohttp"),
    "uvloop": ("uvloop", "uvloop"),
}
# Extras that install a distribution another extra's module needs too: extra -> dist.
SECOND_EXTRAS = {"vllm": "aiohttp"}


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in reqs}


def test_core_dependencies_are_what_a_rollout_client_needs() -> None:
    """The base install: types, codec, client, controller, echo worker. No torch."""
    assert _names(PROJECT["dependencies"]) == {"msgspec", "pyzmq", "numpy"}


def _closure(extra: str) -> set[str]:
    """Distributions an extra installs, following ``fastio[...]`` references."""
    extras = PROJECT["optional-dependencies"]
    out: set[str] = set()
    for req in extras[extra]:
        m = re.fullmatch(r"fastio\[([a-z,]+)\]", req)
        if m:
            for inner in m.group(1).split(","):
                out |= _closure(inner)
        else:
            out |= _names([req])
    return out


def test_each_optional_import_has_its_extra() -> None:
    extras = PROJECT["optional-dependencies"]
    for module, (extra, dist) in OPTIONAL.items():
        assert dist in _names(extras[extra]), (module, extra)
    # ``all`` is every feature extra, in the order they are declared.
    # areal is left out: it is installed without its dependency tree (.ci/areal.sh).
    features = [e for e in extras if e not in ("all", "test", "dev", "areal")]
    assert {e for e, _ in OPTIONAL.values()} <= set(features)
    assert extras["all"] == [f"fastio[{','.join(features)}]"]
    for extra, dist in SECOND_EXTRAS.items():
        assert dist in _names(extras[extra]), extra
    # The full test suite needs every extra: the test and dev extras pull them in.
    assert "fastio[all]" in extras["test"]
    assert "fastio[test]" in extras["dev"]


@pytest.mark.parametrize("extra", ["torch", "reference", "weights", "hf", "demo", "all", "dev"])
def test_extras_that_need_torch_bring_it(extra: str) -> None:
    assert "torch" in _closure(extra)


@pytest.mark.parametrize("extra", ["vlm", "plots", "metrics"])
def test_extras_that_need_no_torch_leave_it_out(extra: str) -> None:
    assert "torch" not in _closure(extra)


def test_license_file_is_the_apache_license_and_declared() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]


def test_missing_extra_hint_works_from_an_index_and_a_checkout() -> None:
    from fastio._optional import require

    with pytest.raises(ImportError) as info:
        require("fastio_no_such_module", "weights", "a test")
    msg = str(info.value)
    assert "a test needs 'fastio_no_such_module'" in msg
    assert "pip install 'fastio[weights]'" in msg
    assert "from a checkout: pip install '.[weights]'" in msg


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
    for name in ("pyproject.toml", "README.md", "LICENSE"):
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
        license_text = z.read(f"fastio-{fastio.__version__}.dist-info/licenses/LICENSE")
    assert tops == {"fastio", "transport", f"fastio-{fastio.__version__}.dist-info"}
    assert meta["Version"] == fastio.__version__
    assert meta["Requires-Python"] == ">=3.11"
    assert "fastio-worker = transport.worker:main" in entry_points
    assert "fastio-demo = transport.demo:main" in entry_points
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert license_text == (ROOT / "LICENSE").read_bytes()

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
