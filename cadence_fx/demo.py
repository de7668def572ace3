"""The demo: one stream through the stock path and through cadence_fx, compared bit for bit.

Models (``--model``):

* ``token2wav`` (default): the real MiniCPM-o 4.5 / Step-Audio2 Token2Wav at its real
  configuration (conformer encoder 6 + 4 blocks, DiT depth 16, 10 Euler steps, HiFT), random
  weights. The prompt-priming pass (``setup_cache``, 302 frames) runs eager by construction and is
  counted; then two turns of 28-token chunks, each turn restoring the prompt state and ending with
  a last (flush) chunk. Each chunk is the flow step then the HiFT step, each compiled on its own.
  On CUDA, deterministic kernels are pinned on both sides (stock HiFT is not reproducible
  without them).
* ``moshi``: Mimi encode + ``LMGen`` step + Mimi decode per 1920-sample frame (the loop of
  ``moshi/server.py``); the 7B LM on CUDA, a 2-layer LM of the same code on the CPU (``config``
  says which). A turn boundary calls the stock ``reset_streaming``; the compiled step restarts
  from a fresh state.
* ``freeze-omni``: the streaming conv + chunked-attention encoder (24 x 1024), 16 fbank frames
  per call, a turn reset in the middle.
* ``toy``: a prompt-retained attention toy with a partial flush and a longer last call.

Each path runs the stream once to warm up (the compiled path traces and captures its classes
then), then ``TIMED_PASSES`` times timed per chunk -- CUDA events on a GPU, ``perf_counter`` on
the CPU; the result has each pass's p50 and the spread between them. On the CPU the compiled path
is the rewritten graph on the guarded eager path (about stock speed); on CUDA it replays CUDA
graphs. Every key of the result is described in docs/benchmarks.md ("The demo's JSON").
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, Optional

import torch

from . import progress
from .demo_streams import BUILDERS as _BUILDERS
from .demo_streams import _same

__all__ = ["run_demo", "MODELS"]

MODELS = tuple(_BUILDERS)


class _Clock:
    """Per-chunk latency: ``tick(i)`` before and after chunk i."""

    def __init__(self, dev: torch.device):
        self.dev, self.times, self._open = dev, [], None

    def __call__(self, i: int) -> None:
        if self._open is None:
            if self.dev.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                self._open = start
            else:
                self._open = time.perf_counter()
            return
        if self.dev.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize()
            self.times.append(self._open.elapsed_time(end))
        else:
            self.times.append((time.perf_counter() - self._open) * 1e3)
        self._open = None


def _p95(xs) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


# -- the run ------------------------------------------------------------------------------------

TIMED_PASSES = 2   # per path; a single pass's p50 swings with the machine's load


def _passes(fn, dev, runs):
    """``runs`` passes of a stream: their results, each pass's per-chunk times, and the
    allocator peak (CUDA) over the last one."""
    results, times = [], []
    for i in range(runs):
        if dev.type == "cuda" and i == runs - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        clock = _Clock(dev)
        results.append(fn(clock))
        times.append(clock.times)
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
    return results, times, peak


def run_demo(model: str = "token2wav", device: str = "cpu", chunks: Optional[int] = None,
             verify: bool = True) -> Dict:
    if model not in _BUILDERS:
        raise ValueError(f"unknown demo model {model!r}; choose from {', '.join(MODELS)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    if chunks is None:
        chunks = 16 if model == "toy" or dev.type == "cuda" else 4
    if chunks < 4:
        raise ValueError("a demo stream needs at least 4 chunks (two turns of two)")
    if model == "token2wav" and dev.type == "cuda":
        from .determinism import pin_deterministic_kernels
        pin_deterministic_kernels()
    progress.note("demo %s on %s: building the model ...", model, dev.type, running=True)
    stream = _BUILDERS[model](dev, chunks)
    progress.note("demo %s: stock stream, %d passes of %d chunks ...", model, 1 + TIMED_PASSES,
                  stream.chunks, running=True)
    stock_runs, stock_times, stock_peak = _passes(stream.stock, dev, 1 + TIMED_PASSES)
    stock_times = stock_times[1:]                            # the first pass warms up
    progress.note("demo %s: stock p50 %.1f ms per chunk", model,
                  statistics.median(sum(stock_times, [])))
    if stream.prepare_compiled is not None:
        stream.prepare_compiled()
    first = stream.compiled(_Clock(dev))                     # traces and captures here
    progress.note("demo %s: compiled, timing and comparing ...", model, running=True)
    warm = {n: (s.counters.replays, s.counters.fallbacks) for n, s in stream.steps.items()}
    timed, times, compiled_peak = _passes(stream.compiled, dev, TIMED_PASSES)
    ref = stock_runs[-1]
    runs = [first, *timed]
    equal = stream.equal or _same
    if verify and stream.audit is not None:  # the shadow auditor on every carry write (syncs)
        progress.note("demo %s: the shadow audit pass (every carry write checked) ...", model,
                      running=True)
        runs.append(stream.extra["audit_run"](lambda i: None))
    bit_exact = all(len(r) == len(ref) and all(map(equal, ref, r)) for r in runs)
    steps = {}
    for name, s in stream.steps.items():
        c = s.counters
        steps[name] = {"calls": c.calls, "replays": c.replays, "fallbacks": c.fallbacks,
                       "steady_replays": c.replays - warm[name][0],
                       "steady_fallbacks": c.fallbacks - warm[name][1],
                       "classes": len(s.classes), "traces": c.traces,
                       "eager_pieces": c.eager_pieces, "guarded_eager": c.guarded_eager,
                       "memory": s.report().memory()}
    total = lambda key: sum(getattr(s.counters, key) for s in stream.steps.values())  # noqa: E731
    # stock pass i against compiled pass i: how far one pass's figure can be trusted
    ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(stock_times, times)]
    result = {
        "model": model, "device": str(dev), "chunks": stream.chunks, "config": stream.config,
        "bit_exact": bit_exact,
        "bit_exact_chunks": sum(equal(a, b) for a, b in zip(ref, timed[-1])),
        "carry_addresses": max(s.counters.carry_addresses for s in stream.steps.values()),
        "retentions": total("retentions"),
        "replays": total("replays"), "fallbacks": total("fallbacks"),
        "steady_replays": sum(s["steady_replays"] for s in steps.values()),
        "steady_fallbacks": sum(s["steady_fallbacks"] for s in steps.values()),
        "invalidations": total("invalidations"), "traces": total("traces"),
        "per_invocation": dict(stream.priming or {}, **steps),
        "timed_passes": TIMED_PASSES,
        "stock_ms_p50": statistics.median(sum(stock_times, [])),
        "compiled_ms_p50": statistics.median(sum(times, [])),
        "stock_ms_p95": _p95(sum(stock_times, [])), "compiled_ms_p95": _p95(sum(times, [])),
        "speedup_p50": statistics.median(sum(stock_times, [])) / statistics.median(sum(times, [])),
        "stock_ms_p50_per_pass": [statistics.median(t) for t in stock_times],
        "compiled_ms_p50_per_pass": [statistics.median(t) for t in times],
        "speedup_p50_spread": [min(ratios), max(ratios)],
        "fallback_reasons": {k: v for s in stream.steps.values() for k, v in s.counters.reasons.items()},
    }
    if dev.type == "cuda":
        # the allocator's peak during the timed pass of each path (weights included)
        result.update(stock_peak_bytes=stock_peak, compiled_peak_bytes=compiled_peak,
                      peak_bytes_kind="max_memory_allocated")
    else:
        result["note"] = ("on the CPU the compiled path runs its rewritten graphs eagerly (no "
                          "device graphs): expect about stock speed; the speedup is a GPU figure")
        # torch reports no CPU allocator peak: the bytes of state each path keeps resident
        carries = sum(c.tensor.numel() * c.tensor.element_size()
                      for s in stream.steps.values() for c in s.carries.values())
        result.update(stock_peak_bytes=stream.extra.get("resident_stock"),
                      compiled_peak_bytes=carries, peak_bytes_kind="resident_state")
    if "addresses" in stream.extra:
        result["stock_state_addresses"] = len(stream.extra["addresses"]["stock"])
    if verify and stream.audit is not None:
        result["audited_writes"] = sum(stream.audit.auditor.comparisons.values())
    return result
