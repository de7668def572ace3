"""The demo: one stream through the stock step and through the compiled step, compared bit for bit.

A stream is a prompt-priming pass (stock, eager by construction), then chunks with a turn reset in
the middle (the prompt state restored), a partial flush before the reset and a longer last call.
Latency is per chunk: CUDA events on a GPU, ``perf_counter`` on the CPU; both paths run the stream
once to warm up (the compiled path traces its classes then) and are timed on the second run.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch

__all__ = ["run_demo", "MODELS"]

MODELS = ("toy",)


def _toy(device, chunks):
    from .models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
    model = PromptRetainedToy(dim=256, heads=4, layers=4).to(device)
    adapter = PROMPT_RETAINED_ADAPTER.with_clocks(layers=4, kv_width=2 * 256 // 4)
    c = adapter.clocks
    g = torch.Generator().manual_seed(7)
    prompt = torch.randn(1, c["f_prompt"], 256, generator=g).to(device)
    with torch.no_grad():
        _, state = model(prompt, None)
    prompt_state = {k: v.clone() for k, v in state.items()}
    widths = _widths(chunks, c["f_chunk"], c["f_call"], partial=c["f_chunk"] // 2)
    inputs = [((torch.randn(1, w, 256, generator=g).to(device),), {}) for w in widths]
    return model, adapter, prompt_state, inputs, (lambda args, s: (*args, s))


def _widths(chunks: int, chunk: int, last: int, partial: int) -> List[int]:
    """Steady chunks, a partial flush ending the first turn, steady chunks, a longer last call."""
    half = chunks // 2
    first = [chunk] * (half - 1) + [partial]
    second = [chunk] * (chunks - half - 1) + [last]
    return first + second


def _run(step: Callable, inputs, prompt_state, call, reset_at: int, device) -> Tuple[list, list, set]:
    outs, times, addresses = [], [], set()
    state = prompt_state
    for i, (args, kwargs) in enumerate(inputs):
        if i == reset_at:
            state = prompt_state  # turn boundary: restore the prompt state
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        with torch.inference_mode():
            result = step(*call(args, state), **kwargs)
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
        out, state = result[0], result[1]
        addresses.update(v.data_ptr() for v in state.values())
        outs.append((out.clone(), {k: v.clone() for k, v in state.items()}))
    return outs, times, addresses


def _timed_runs(step, inputs, prompt_state, call, reset_at, dev, runs: int = 2):
    """``runs`` passes over the stream; the allocator peak (CUDA) is taken over the last one."""
    results = []
    for i in range(runs):
        if dev.type == "cuda" and i == runs - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        results.append(_run(step, inputs, prompt_state, call, reset_at, dev))
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
    return results, peak


def _p95(xs) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def _equal(a, b) -> bool:
    (ya, sa), (yb, sb) = a, b
    if not torch.equal(ya, yb):
        return False
    for k in sa:
        x, y = sa[k], sb[k]
        if x.shape != y.shape:  # undeclared stock rows must be zero (see the runtime)
            cut = tuple(slice(0, s) for s in y.shape)
            if not torch.equal(x[cut], y) or x.count_nonzero() != x[cut].count_nonzero():
                return False
        elif not torch.equal(x, y):
            return False
    return True


def run_demo(model: str = "toy", device: str = "cpu", chunks: int = 16, verify: bool = True) -> Dict:
    import cadence_fx
    if chunks < 4:
        raise ValueError("a demo stream needs at least 4 chunks (two turns of two)")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    if model != "toy":
        raise ValueError(f"unknown demo model {model!r}; choose from {', '.join(MODELS)}")
    module, adapter, prompt_state, inputs, call = _toy(dev, chunks)
    reset_at = chunks // 2
    compiled = cadence_fx.compile(module, adapter)
    stock_runs, stock_peak = _timed_runs(module, inputs, prompt_state, call, reset_at, dev)
    first = _run(compiled, inputs, prompt_state, call, reset_at, dev)  # traces and captures here
    warm = (compiled.counters.replays, compiled.counters.fallbacks)
    second, compiled_peak = _timed_runs(compiled, inputs, prompt_state, call, reset_at, dev, runs=1)
    compiled_runs = [first] + second
    ref, times = stock_runs[1][0], compiled_runs[1][1]
    runs = [r[0] for r in compiled_runs]
    audited = None
    if verify:  # a third pass with the shadow auditor on every carry write (it syncs: not timed)
        audited = cadence_fx.compile(module, adapter, verify=True)
        runs.append(_run(audited, inputs, prompt_state, call, reset_at, dev)[0])
    bit_exact = all(_equal(a, b) for run in runs for a, b in zip(ref, run))
    counters = compiled.counters
    carry_bytes = sum(c.tensor.numel() * c.tensor.element_size() for c in compiled.carries.values())
    stock_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
    if dev.type == "cuda":
        stock_bytes, carry_bytes, kind = stock_peak, compiled_peak, "max_memory_allocated"
    else:
        kind = "resident_state"
    return {
        "model": model, "device": str(dev), "chunks": len(inputs), "bit_exact": bit_exact,
        "carry_addresses": counters.carry_addresses,
        "stock_state_addresses": len(stock_runs[1][2]),
        "retentions": counters.retentions,
        "audited_writes": sum(audited.auditor.comparisons.values()) if audited else 0,
        "replays": counters.replays, "fallbacks": counters.fallbacks,
        "steady_replays": counters.replays - warm[0], "steady_fallbacks": counters.fallbacks - warm[1],
        "invalidations": counters.invalidations, "traces": counters.traces,
        "stock_ms_p50": statistics.median(stock_runs[1][1]),
        "compiled_ms_p50": statistics.median(times),
        "stock_ms_p95": _p95(stock_runs[1][1]), "compiled_ms_p95": _p95(times),
        # CUDA: the allocator's peak during the timed stream of each path. CPU: torch reports no
        # allocator peak, so these are the bytes of state each path keeps resident (the stock
        # envelope buffers vs the carries).
        "stock_peak_bytes": stock_bytes, "compiled_peak_bytes": carry_bytes,
        "peak_bytes_kind": kind,
        "fallback_reasons": dict(counters.reasons),
    }
