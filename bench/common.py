"""Shared pieces of the benchmark suites: measurements, timing, machine description.

A suite is a module ``bench/<name>.py`` exposing ``run(quick: bool) -> list[Measurement]``.
Ours is ``impl="fastio"``; baselines carry their own name and are measured in the same
run, so reports compare ratios, not absolute times (these machines are shared and noisy).
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["FASTIO", "Measurement", "machine_info", "timeit"]

FASTIO = "fastio"


@dataclass
class Measurement:
    """One case measured for one implementation.

    ``size`` is the x axis of plots (bytes, tokens or parameters, named in
    ``extra["size_unit"]``). ``median_s`` is the median of ``samples`` (seconds per
    operation). ``extra`` holds anything else worth reporting (throughput, peak RSS,
    per-bucket timings).
    """

    suite: str
    case: str
    impl: str
    size: int
    median_s: float
    samples: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_samples(
        cls, suite: str, case: str, impl: str, size: int, samples: list[float], **extra: Any
    ) -> Measurement:
        """Build a measurement whose ``median_s`` is the median of ``samples``."""
        return cls(suite, case, impl, size, statistics.median(samples), list(samples), extra)


def timeit(
    fn: Callable[[], Any], *, repeat: int = 7, number: int = 1, warmup: int = 1
) -> list[float]:
    """Time ``fn``: ``repeat`` samples of ``number`` calls each, in seconds per call.

    The garbage collector is paused inside each sample (as ``timeit`` does) so one
    suite's garbage does not land in another's figures.
    """
    for _ in range(warmup):
        fn()
    samples = []
    enabled = gc.isenabled()
    try:
        for _ in range(repeat):
            gc.disable()
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            samples.append((time.perf_counter() - t0) / number)
            if enabled:
                gc.enable()
    finally:
        if enabled:
            gc.enable()
    return samples


def machine_info() -> dict[str, Any]:
    """Machine and library versions, printed and stored with every report."""
    import msgspec
    import numpy
    import zmq

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "msgspec": msgspec.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "numpy": numpy.__version__,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover - torch is a dependency
        info["torch"] = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln for ln in f if ln.startswith("model name")), "")
        if model:
            info["cpu_model"] = " ".join(model.split(":", 1)[1].split())
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(f.readline().split()[1])
    except OSError:
        pass
    return info
