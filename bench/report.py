"""Turn measurements into ratios, a markdown table, a JSON document and PNG plots, and
check ratios against a committed reference.

A *ratio* is ``baseline median / fastio median`` for one case: above 1 fastio is faster.
Only ratios are compared across runs, since absolute times on shared machines drift.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.common import FASTIO, Measurement

__all__ = ["check", "markdown", "plot", "ratios", "write_json"]


def ratios(ms: list[Measurement]) -> dict[str, float]:
    """``{"suite/case vs baseline": baseline_median / fastio_median}`` for every case that
    has a fastio measurement and at least one baseline."""
    by_case: dict[tuple[str, str], dict[str, Measurement]] = defaultdict(dict)
    for m in ms:
        by_case[(m.suite, m.case)][m.impl] = m
    out: dict[str, float] = {}
    for (suite, case), impls in sorted(by_case.items()):
        ours = impls.get(FASTIO)
        if ours is None or ours.median_s <= 0:
            continue
        for impl, m in sorted(impls.items()):
            if impl != FASTIO:
                out[f"{suite}/{case} vs {impl}"] = m.median_s / ours.median_s
    return out


def _fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def markdown(ms: list[Measurement], info: dict[str, Any]) -> str:
    """A markdown report: one table per suite (median per impl, ratio to fastio)."""
    lines = ["# fastio benchmarks", ""]
    lines.append("Machine: " + ", ".join(f"{k}={v}" for k, v in info.items() if k not in ("argv",)))
    lines.append("")
    lines.append(
        "Ratio = baseline median / fastio median, measured in the same run (>1: fastio faster)."
    )
    by_suite: dict[str, list[Measurement]] = defaultdict(list)
    for m in ms:
        by_suite[m.suite].append(m)
    for suite, items in by_suite.items():
        lines += [
            "",
            f"## {suite}",
            "",
            "| case | impl | median | ratio | notes |",
            "|---|---|---|---|---|",
        ]
        fastio_median = {m.case: m.median_s for m in items if m.impl == FASTIO}
        for m in items:
            ours = fastio_median.get(m.case)
            ratio = "" if m.impl == FASTIO or not ours else f"{m.median_s / ours:.2f}x"
            notes = ", ".join(
                f"{k}={_fmt_extra(v)}" for k, v in m.extra.items() if k not in ("plot", "size_unit")
            )
            lines.append(f"| {m.case} | {m.impl} | {_fmt_time(m.median_s)} | {ratio} | {notes} |")
    return "\n".join(lines) + "\n"


def _fmt_extra(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and len(v) > 6:
        return f"[{len(v)} items]"
    return str(v)


def write_json(path: Path, ms: list[Measurement], info: dict[str, Any]) -> None:
    """Machine-readable results: machine info, measurements and ratios."""
    doc = {"machine": info, "measurements": [m.to_dict() for m in ms], "ratios": ratios(ms)}
    path.write_text(json.dumps(doc, indent=1, default=str))


def _family(m: Measurement) -> str:
    plot = m.extra.get("plot")
    if isinstance(plot, str):
        return plot
    return re.sub(r"[@_\-]?\d+(\.\d+)?\s*[kKmMgG]?(i?B)?$", "", m.case)


def plot(ms: list[Measurement], out_dir: Path) -> list[Path]:
    """One PNG per (suite, family) that has at least two sizes: median time against size,
    one line per implementation, log-log. Returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, str], list[Measurement]] = defaultdict(list)
    for m in ms:
        groups[(m.suite, _family(m))].append(m)
    written = []
    for (suite, family), items in sorted(groups.items()):
        if len({m.size for m in items}) < 2:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        by_impl: dict[str, list[Measurement]] = defaultdict(list)
        for m in items:
            by_impl[m.impl].append(m)
        # Throughput cases are plotted as throughput (higher is better), the rest as time.
        rate_key = next(
            (k for k in ("MiB_per_s", "req_per_s") if all(k in m.extra for m in items)), None
        )
        for impl, pts in sorted(by_impl.items()):
            pts.sort(key=lambda m: m.size)
            ys = [m.extra[rate_key] if rate_key else m.median_s for m in pts]
            ax.plot([m.size for m in pts], ys, marker="o", label=impl)
        unit = items[0].extra.get("size_unit", "bytes")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"size ({unit})")
        ax.set_ylabel(rate_key.replace("_per_s", "/s") if rate_key else "median time (s)")
        ax.set_title(f"{suite}: {family}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"{suite}-{re.sub(r'[^A-Za-z0-9]+', '_', family).strip('_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def check(current: dict[str, float], reference: dict[str, float], tolerance: float) -> list[str]:
    """Compare ratios to a reference. A ratio below ``reference * (1 - tolerance)`` is a
    regression. Ratios missing from this run are reported too (a suite stopped measuring
    a case). Returns the list of problems, empty when fine."""
    problems = []
    for key, ref in sorted(reference.items()):
        cur = current.get(key)
        if cur is None:
            problems.append(f"{key}: missing from this run (reference {ref:.2f}x)")
        elif cur < ref * (1 - tolerance):
            problems.append(
                f"{key}: {cur:.2f}x, below {ref:.2f}x reference by more than {tolerance:.0%}"
            )
    return problems
