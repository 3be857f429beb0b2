"""Run the benchmark suites and write a markdown table, a JSON file and PNG plots.

Examples
--------
``python -m bench --quick``                       all suites, small sizes (< 2 min here)
``python -m bench --suite codec``                 one suite, full sizes
``python -m bench --quick --check bench/reference.json``   fail on a ratio regression
``python -m bench --replot bench/results/results.json --out bench/results``   re-render
the table and plots of a stored run without measuring

``bench`` is not part of the installed package: run it from a checkout. Plots need
matplotlib (``pip install -e '.[plots]'``); without it the tables are still written.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

from bench.common import Measurement, machine_info
from bench.report import check, markdown, plot, ratios, read_json, write_json

SUITES = ("codec", "transport", "weights")


def from_pytest_benchmark(path: Path) -> list[Measurement]:
    """Measurements (suite ``hotpaths``) from a pytest-benchmark JSON file: the group is the
    case, ``extra_info["impl"]`` the implementation."""
    doc = json.loads(path.read_text())
    out = []
    for b in doc["benchmarks"]:
        stats = b["stats"]
        out.append(
            Measurement(
                "hotpaths",
                b["group"],
                b["extra_info"].get("impl", b["name"]),
                0,
                stats["median"],
                [],
                {"rounds": stats["rounds"], "min_s": stats["min"]},
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (CI mode)")
    p.add_argument("--suite", default=",".join(SUITES), help=f"comma list of {SUITES}")
    p.add_argument("--out", default="bench/out", help="directory for results.md/.json and plots")
    p.add_argument("--no-plots", action="store_true", help="skip PNG plots")
    p.add_argument("--check", metavar="REFERENCE", help="compare ratios with a reference JSON")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.5,
        help="allowed relative drop of a ratio before --check fails (default 0.5)",
    )
    p.add_argument(
        "--pytest-json",
        metavar="PATH",
        help="also include a pytest-benchmark JSON (bench/test_hotpaths.py) as suite 'hotpaths'",
    )
    p.add_argument(
        "--lower-reference",
        metavar="PATH",
        help="lower the ratios of a reference to this run's where they are lower (run it a "
        "few times: the reference becomes the worst run, so the check flags regressions, "
        "not noise); an existing reference keeps its own list of ratios",
    )
    p.add_argument(
        "--replot",
        metavar="RESULTS_JSON",
        help="measure nothing: re-render results.md and the plots of a stored results.json",
    )
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Checked before minutes of measuring, not after.
    plots = not args.no_plots
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            plots = False
            print(
                "no plots: matplotlib is not installed (pip install 'fastio[plots]', or "
                "pip install -e '.[plots]' in this checkout); tables only",
                flush=True,
            )
    suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    for name in suites:
        if name not in SUITES:
            p.error(f"unknown suite {name!r}; choose from {SUITES}")

    if args.replot:
        ms, info = read_json(Path(args.replot))
        (out / "results.md").write_text(markdown(ms, info))
        write_json(out / "results.json", ms, info)
        print("tables:", out / "results.md", out / "results.json")
        for path in plot(ms, out, info) if plots else []:
            print("plot:", path)
        return 0

    info = machine_info()
    info["mode"] = "quick" if args.quick else "full"
    print("machine:", json.dumps(info), flush=True)

    ms: list[Measurement] = []
    for name in suites:
        module = importlib.import_module(f"bench.{name}")
        t0 = time.perf_counter()
        print(f"== suite {name} ...", flush=True)
        got = module.run(quick=args.quick)
        print(
            f"== suite {name}: {len(got)} measurements in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        ms.extend(got)

    if args.pytest_json:
        ms.extend(from_pytest_benchmark(Path(args.pytest_json)))

    md = markdown(ms, info)
    (out / "results.md").write_text(md)
    write_json(out / "results.json", ms, info)
    print(md)
    if plots:
        for path in plot(ms, out, info):
            print("plot:", path)
    current = ratios(ms)
    if args.lower_reference:
        path = Path(args.lower_reference)
        # An existing reference is a curated list of the ratios that matter (the issues'
        # targets): only those are lowered. A new reference starts with every ratio.
        merged = json.loads(path.read_text()) if path.exists() else dict(current)
        for key in merged:
            if key in current:
                merged[key] = min(current[key], merged[key])
        path.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        print("reference updated:", path)
    if args.check:
        reference = json.loads(Path(args.check).read_text())
        measured = set(suites) | ({"hotpaths"} if args.pytest_json else set())
        wanted = {k: v for k, v in reference.items() if k.split("/", 1)[0] in measured}
        problems = check(current, wanted, args.tolerance)
        if problems:
            print("BENCHMARK REGRESSION:", *problems, sep="\n  ")
            return 1
        print(f"benchmark check: {len(wanted)} ratios within {args.tolerance:.0%} of the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
