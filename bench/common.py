"""What the benchmark scripts share: latency statistics, timing with CUDA events, the identity of
a run and its result file.

Every script puts ``bench/`` first on ``sys.path`` by being run from it (``python bench/x.py``)
and imports this module as ``common``; nothing here imports from ``tests/``.

* ``p95`` and ``median``: per-chunk statistics in milliseconds (``p95`` is the sample at rank
  round(0.95 (n - 1)), no interpolation, as every committed result computed it).
* ``cuda_timed(fn)``: run ``fn()`` between two CUDA events, synchronize, return its result and
  the milliseconds between them (device time of the work ``fn`` queued, host gaps included).
* ``run_info()`` and ``write_result(path, result)``: the GPU, torch and commit every result file
  opens with (``CADENCE_COMMIT``, set by ``bench/device.sh``), and the file itself.
* ``parser(__doc__, depth=16, chunks=12)``: a script's command line, ``--out`` (the result file)
  and one whole-number option per keyword with its default.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Callable, Sequence, Tuple, TypeVar

import torch

from cadence_fx.serve.host import GcPauses   # the collector's pauses, as the replicas keep them

__all__ = ["DEADLINE_MS", "p95", "median", "cuda_timed", "run_info", "write_result", "parser",
           "busy_us", "kernel_summary", "GcPauses"]

T = TypeVar("T")

DEADLINE_MS = 1000.0   # a Token2Wav chunk: 50 mel frames at 50 Hz, one second of audio


def p95(xs: Sequence[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def cuda_timed(fn: Callable[[], T]) -> Tuple[T, float]:
    """``fn()`` timed with CUDA events: ``(result, ms)``, after a synchronize."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    torch.cuda.synchronize()
    return out, start.elapsed_time(end)


def run_info(**extra) -> dict:
    """The keys every result file opens with: where and at which commit it ran."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__,
            "commit": os.environ.get("CADENCE_COMMIT", "unknown"), **extra}


def write_result(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def parser(description: str, **numbers: int) -> argparse.ArgumentParser:
    """``--out`` (the result file, required) and ``--<name>`` per keyword, a whole number with
    that default (``skip_draws=3``: ``--skip-draws``); ``description`` opens ``--help``."""
    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    for name, default in numbers.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    return ap


def busy_us(intervals: Sequence[Tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: the time a device was busy with
    kernels that may overlap (several streams), each instant counted once."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def kernel_summary(prof, top: int = 8, width: int = 60) -> dict:
    """What a profiler run (``torch.profiler.profile``, CUDA activity) put on the device: the
    kernel ms summed over streams, the launches, and the ``top`` largest by device time as
    (name cut to ``width``, ms, launches)."""
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    return {"kernel_ms": sum(e.self_device_time_total for e in events) / 1e3,
            "launches": sum(e.count for e in events),
            "top": [(e.key[:width], round(e.self_device_time_total / 1e3, 2), e.count) for e in
                    sorted(events, key=lambda e: -e.self_device_time_total)[:top]]}
