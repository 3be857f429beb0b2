"""Turn measurements into ratios, a markdown table, a JSON document and PNG plots, and
check ratios against a committed reference.

A *ratio* is ``baseline median / fastio median`` for one case: above 1 fastio is faster.
Only ratios are compared across runs, since absolute times on shared machines drift.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.common import FASTIO, Measurement

__all__ = [
    "check",
    "fmt_bytes",
    "fmt_count",
    "fmt_time",
    "markdown",
    "plot",
    "ratios",
    "read_json",
    "write_json",
]


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


def read_json(path: Path) -> tuple[list[Measurement], dict[str, Any]]:
    """Measurements and machine info back from a file :func:`write_json` wrote, so the
    report and plots can be re-rendered without measuring again."""
    doc = json.loads(path.read_text())
    return [Measurement(**m) for m in doc["measurements"]], dict(doc["machine"])


def _family(m: Measurement) -> str:
    plot = m.extra.get("plot")
    if isinstance(plot, str):
        return plot
    return re.sub(r"[@_\-]?\d+(\.\d+)?\s*[kKmMgG]?(i?B)?$", "", m.case)


# What each plotted family measures, for the title (fallback: "suite: family").
TITLES = {
    ("codec", "response_roundtrip"): "LLMResponse encode + decode",
    ("codec", "response_encode"): "LLMResponse encode",
    ("codec", "response_decode"): "LLMResponse decode",
    ("codec", "response_decode_scaling"): "LLMResponse decode: long vs short",
    ("codec", "tensor_encode"): "float32 tensor encode",
    ("codec", "tensor_decode"): "float32 tensor decode",
    ("codec", "tensor_encode_scaling"): "float32 tensor encode: large vs small",
    ("transport", "rtt"): "Round trip, client + echo worker processes",
    ("transport", "throughput"): "Throughput, 1 client + 2 echo workers",
    ("weights", "tcp"): "Weight update to 2 worker processes, TCP",
    ("weights", "shm"): "Weight update to 2 worker processes, shared memory",
    ("weights", "gpu-tcp"): "GPU weight update, TCP",
    ("weights", "gpu-shm"): "GPU weight update, same host",
}

STRONG = "#1f5fbf"  # fastio
MUTED = ("#9a9a9a", "#c49a6c", "#8fb3a3", "#b58fb5", "#a3a3d1", "#c9c26d")
MARKERS = ("s", "^", "D", "v", "P", "X")
LOG_SPAN = 50.0  # an axis goes logarithmic only when its values span more than this factor


def fmt_time(s: float) -> str:
    """Seconds as a short label in ns, us, ms or s ("3.6 us", "570 ms")."""
    a = abs(s)
    if a == 0:
        return "0"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")):
        if a >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def _num(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def fmt_bytes(n: float) -> str:
    """Bytes as a short binary-prefixed label ("64 B", "1 KiB", "241 MiB", "1 GiB")."""
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if abs(n) >= scale:
            return f"{_num(n / scale)} {unit}"
    return f"{_num(n)} B"


def fmt_count(n: float, unit: str = "") -> str:
    """A count as "570", "49.4k", "1.2M" (decimal prefixes), with an optional unit."""
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{_num(n / scale)}{prefix}{unit}"
    return f"{_num(n)}{unit}"


def _fmt_size(n: float, unit: str) -> str:
    if unit == "bytes":
        return fmt_bytes(n)
    if unit == "tokens":  # the suites name token counts in binary thousands: 1k, 32k, 128k
        return f"{n / 1024:.3g}k" if n >= 1024 else f"{n:.0f}"
    return fmt_count(n)


def _time_unit(top: float) -> tuple[float, str]:
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if top >= scale:
            return scale, unit
    return 1e-9, "ns"


def _note(info: dict[str, Any]) -> str:
    """The machine and the run, printed on every plot."""
    cpu = info.get("cpu_model") or info.get("machine", "?")
    parts = [f"{cpu}, {info.get('cpus', '?')} CPUs"]
    if info.get("mem_total_kib"):
        parts[0] += f", {info['mem_total_kib'] / (1 << 20):.0f} GiB"
    if info.get("cuda"):
        parts.append(str(info["cuda"]))
    parts.append(f"Python {info.get('python', '?')}, torch {info.get('torch', '?')}")
    parts.append(f"{info.get('mode', '?')} run {info.get('date', '(date not recorded)')}")
    return " | ".join(parts) + " | median of repeats"


def plot(ms: list[Measurement], out_dir: Path, info: dict[str, Any] | None = None) -> list[Path]:
    """One PNG per (suite, family) with at least two sizes; returns the written paths.

    Sweeps (each implementation at several sizes) are lines, fastio in one strong colour
    and the baselines muted; an axis is logarithmic only where its values span more than
    ``LOG_SPAN``. Families where each implementation has a single size (the
    ``*_scaling`` cases: one cost at a small and at a large size) are bars on a linear
    axis from zero. Times are labelled in us/ms/s, sizes in KiB/MiB/GiB, throughput in
    req/s, and each plot carries a note of the machine and the date.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import (
        FixedLocator,
        FuncFormatter,
        LogLocator,
        NullFormatter,
        NullLocator,
    )

    info = info or {}
    groups: dict[tuple[str, str], list[Measurement]] = defaultdict(list)
    for m in ms:
        groups[(m.suite, _family(m))].append(m)
    written = []
    for (suite, family), items in sorted(groups.items()):
        sizes = sorted({m.size for m in items})
        if len(sizes) < 2:
            continue
        by_impl: dict[str, list[Measurement]] = defaultdict(list)
        for m in items:
            by_impl[m.impl].append(m)
        unit = str(items[0].extra.get("size_unit", "bytes"))
        # Throughput cases are plotted as requests per second (higher is better).
        rate = all("req_per_s" in m.extra for m in items)

        def y_of(m: Measurement, rate: bool = rate) -> float:
            return float(m.extra["req_per_s"]) if rate else m.median_s

        ys = [y_of(m) for m in items]
        fig, ax = plt.subplots(figsize=(7, 4.4))
        title = TITLES.get((suite, family), f"{suite}: {family}")
        better = "higher is better" if rate else "lower is better"
        ax.set_title(f"{title}\n({better})", fontsize=11)
        bars = all(len(pts) == 1 for pts in by_impl.values())
        if bars:
            pts = sorted(items, key=lambda m: m.size)
            scale, tunit = _time_unit(max(ys))
            suffix = "" if unit == "bytes" else f" {unit}"
            labels = [_fmt_size(m.size, unit) + suffix for m in pts]
            heights = [y_of(m) / scale for m in pts]
            colours = [STRONG if m.impl.startswith(FASTIO) else MUTED[0] for m in pts]
            rects = ax.bar(labels, heights, color=colours, width=0.5)
            ax.bar_label(rects, [f"{h:.3g} {tunit}" for h in heights], padding=3)
            ax.set_ylim(0, max(heights) * 1.2)
            ax.set_ylabel(f"median time ({tunit})")
            ax.set_xlabel("fastio, same code path at two sizes")
        else:
            order = sorted(by_impl, key=lambda i: (not i.startswith(FASTIO), i))
            muted = iter(zip(MUTED * 2, MARKERS * 2, strict=True))
            for impl in order:
                pts = sorted(by_impl[impl], key=lambda m: m.size)
                xs = [m.size for m in pts]
                if impl == FASTIO:
                    style: dict[str, Any] = {
                        "color": STRONG,
                        "lw": 2.6,
                        "marker": "o",
                        "ms": 7,
                        "zorder": 5,
                    }
                else:
                    colour, marker = next(muted)
                    style = {"color": colour, "lw": 1.4, "marker": marker, "ms": 5, "zorder": 3}
                ax.plot(xs, [y_of(m) for m in pts], label=impl, **style)
            xlog = sizes[-1] / max(sizes[0], 1) > LOG_SPAN
            ylog = max(ys) / max(min(ys), 1e-12) > LOG_SPAN
            ax.set_xscale("log" if xlog else "linear")
            ax.xaxis.set_major_locator(FixedLocator(sizes))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p, u=unit: _fmt_size(v, u)))
            if not xlog:
                ax.set_xlim(0, sizes[-1] * 1.08)
            # set_yscale resets the tick formatters: scale first, then label.
            ax.set_yscale("log" if ylog else "linear")
            if ylog:
                # 1-2-5 ticks over a few decades, one per decade over many.
                decades = math.log10(max(ys) / min(ys))
                ax.yaxis.set_major_locator(
                    LogLocator(subs=(1.0, 2.0, 5.0) if decades < 4 else (1.0,))
                )
                ax.yaxis.set_minor_formatter(NullFormatter())
            else:
                ax.set_ylim(0, max(ys) * 1.1)
            if rate:
                ax.set_ylabel("requests per second")
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: fmt_count(v)))
            elif ylog:
                ax.set_ylabel("median time")
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: fmt_time(v)))
            else:
                scale, tunit = _time_unit(max(ys))
                ax.set_ylabel(f"median time ({tunit})")
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p, s=scale: f"{v / s:.3g}"))
            xname = {"bytes": "payload size", "tokens": "response length (tokens)"}.get(unit, unit)
            ax.set_xlabel(xname)
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(frameon=False)
        fig.text(0.01, 0.01, _note(info), fontsize=6.5, color="#666666", ha="left", va="bottom")
        fig.tight_layout(rect=(0, 0.04, 1, 1))
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
