"""bench.report and ``python -m bench``: labels in human units, tables without matplotlib."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.common import Measurement
from bench.report import fmt_bytes, fmt_count, fmt_time, read_json, write_json

ROOT = Path(__file__).resolve().parents[1]


def test_units_a_person_reads() -> None:
    assert fmt_time(3.6e-6) == "3.6 us"
    assert fmt_time(0.00187) == "1.87 ms"
    assert fmt_time(0.57) == "570 ms"
    assert fmt_time(1.13) == "1.13 s"
    assert fmt_time(3.4e-7) == "340 ns"
    assert fmt_bytes(64) == "64 B"
    assert fmt_bytes(1024) == "1 KiB"
    assert fmt_bytes(64 << 20) == "64 MiB"
    assert fmt_bytes(1059196928) == "1010 MiB"
    assert fmt_bytes(1 << 30) == "1 GiB"
    assert fmt_count(49394) == "49.4k"
    assert fmt_count(570) == "570"
    assert fmt_count(1_200_000, " req/s") == "1.2M req/s"


def _results(path: Path) -> Path:
    ms = [
        Measurement(
            "transport",
            f"throughput@{n}",
            impl,
            n,
            t,
            [t],
            {"size_unit": "bytes", "req_per_s": 1 / t},
        )
        for n, f in ((64, 1.0), (65536, 8.0), (1 << 20, 90.0))
        for impl, t in (("fastio", 2e-5 * f), ("raw-pyzmq", 1.3e-5 * f))
    ]
    ms += [
        Measurement(
            "codec",
            "tensor_encode_scaling",
            "fastio",
            1 << 30,
            3.8e-6,
            [3.8e-6],
            {"size_unit": "bytes"},
        ),
        Measurement(
            "codec",
            "tensor_encode_scaling",
            "fastio-1KiB",
            1024,
            3.6e-6,
            [3.6e-6],
            {"size_unit": "bytes"},
        ),
    ]
    write_json(path, ms, {"date": "2026-11-30", "cpus": 2, "mode": "quick"})
    return path


def test_results_json_round_trips(tmp_path: Path) -> None:
    ms, info = read_json(_results(tmp_path / "results.json"))
    assert info["date"] == "2026-11-30"
    assert ms[0] == Measurement(
        "transport",
        "throughput@64",
        "fastio",
        64,
        2e-5,
        [2e-5],
        {"size_unit": "bytes", "req_per_s": 1 / 2e-5},
    )


_NO_MATPLOTLIB = textwrap.dedent(
    """
    import sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "matplotlib" or name.startswith("matplotlib."):
                raise ImportError(f"blocked {name}")
            return None

    sys.meta_path.insert(0, Block())
    """
)


def _run_bench(args: list[str], block_matplotlib: bool) -> subprocess.CompletedProcess[str]:
    prelude = (
        "import sys\n"
        + (_NO_MATPLOTLIB if block_matplotlib else "")
        + "from bench.__main__ import main\n"
        f"sys.exit(main({args!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_tables_without_matplotlib(tmp_path: Path) -> None:
    """Without matplotlib the tables are written and one line says how to get plots."""
    src = _results(tmp_path / "in.json")
    out = tmp_path / "out"
    run = _run_bench(["--replot", str(src), "--out", str(out)], block_matplotlib=True)
    assert run.returncode == 0, run.stderr
    hints = [ln for ln in run.stdout.splitlines() if "fastio[plots]" in ln]
    assert len(hints) == 1, run.stdout
    assert "| throughput@64 | fastio |" in (out / "results.md").read_text()
    assert json.loads((out / "results.json").read_text())["machine"]["date"] == "2026-11-30"
    assert not list(out.glob("*.png"))


@pytest.mark.slow
def test_plots_with_matplotlib(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    src = _results(tmp_path / "in.json")
    out = tmp_path / "out"
    run = _run_bench(["--replot", str(src), "--out", str(out)], block_matplotlib=False)
    assert run.returncode == 0, run.stderr
    assert "fastio[plots]" not in run.stdout
    assert sorted(p.name for p in out.glob("*.png")) == [
        "codec-tensor_encode_scaling.png",
        "transport-throughput.png",
    ]
