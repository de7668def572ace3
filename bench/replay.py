"""ExactShapeReplay benchmark: stock eager vs cadence_fx on one GPU, measured in the same run.

    python bench/replay.py --out results.json [--depth 16] [--chunks 12]

Parts: (1) the toy stream (guard cost, output-copy cost); (2) the real Token2Wav CFM chunk
(``CausalConditionalCFM.forward_chunk`` + retention, real DiT configuration, random weights)
over a stream with turn resets and 56-frame last calls, under ``autocast("cuda", float32)`` as the
stock loop runs it. Latency per chunk from CUDA events after a warm-up pass; p50/p95; peak
memory by ``torch.cuda.max_memory_allocated``; bit-exactness by ``torch.equal`` on every chunk.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import torch

import cadence_fx
from cadence_fx.replay import GuardedPiece
from common import cuda_timed, median, p95


def stream(step, chunks, prompt_state, resets, call, autocast=False):
    """Run ``step`` over ``chunks``; returns (outputs cloned, per-chunk ms, state addresses)."""
    outs, times, addresses, state = [], [], set(), prompt_state
    for i, args in enumerate(chunks):
        if i in resets:
            state = prompt_state

        def chunk():
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float32, enabled=autocast):
                return call(step, args, state)

        (out, state), ms = cuda_timed(chunk)
        times.append(ms)
        addresses.update(v.data_ptr() for v in state.values())
        # references live on the host, so the device peak is the step's own
        outs.append((out.cpu(), {k: v.cpu() for k, v in state.items()}))
    return outs, times, addresses


def equal(a, b):
    (ya, sa), (yb, sb) = a, b
    if not torch.equal(ya, yb):
        return False
    for k in sa:
        x, y = sa[k], sb[k]
        cut = tuple(slice(0, s) for s in y.shape)
        if not torch.equal(x[cut], y) or x.count_nonzero() != x[cut].count_nonzero():
            return False
    return True


def summary(times):
    return {"p50_ms": round(median(times), 3), "p95_ms": round(p95(times), 3),
            "mean_ms": round(statistics.fmean(times), 3)}


def guard_cost(compiled, call_args, state, call):
    """Seconds per guard check of the first capturable piece (plain data comparisons)."""
    entry = next(iter(compiled.classes.values()))
    piece = next(m for m in entry.gm.modules() if isinstance(m, GuardedPiece) and m.kind == "graph")
    seen = {}
    forward = piece.forward

    def spy(*a):
        seen["args"] = a
        return forward(*a)

    piece.forward = spy
    with torch.inference_mode():
        call(compiled, call_args, state)
    piece.forward = forward
    args = seen.get("args")
    if args is None:
        return None
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        piece.guard(args)
    return (time.perf_counter() - t0) / n * 1e6


def toy_part(chunks):
    from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
    dim, layers = 512, 8
    model = PromptRetainedToy(dim=dim, heads=8, layers=layers).cuda()
    adapter = PROMPT_RETAINED_ADAPTER.with_clocks(layers=layers, heads=8, kv_width=2 * dim // 8)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        _, st = model(torch.randn(1, 24, dim, generator=g).cuda(), None)
    prompt = {k: v.clone() for k, v in st.items()}
    widths = ([8] * (chunks // 2 - 1) + [10]) * 2
    xs = [(torch.randn(1, w, dim, generator=g).cuda(),) for w in widths]
    resets = {0, len(xs) // 2}
    call = lambda s, a, state: s(a[0], state)  # noqa: E731
    stream(model, xs, prompt, resets, call)
    stock, st_times, _ = stream(model, xs, prompt, resets, call)
    res = {"stock": summary(st_times)}
    for copy_outputs in (True, False):
        c = cadence_fx.compile(model, adapter, copy_outputs=copy_outputs)
        stream(c, xs, prompt, resets, call)
        ours, times, addr = stream(c, xs, prompt, resets, call)
        res[f"cadence_copy_outputs_{copy_outputs}"] = {
            **summary(times), "bit_exact": all(equal(a, b) for a, b in zip(stock, ours)),
            "replays": c.counters.replays, "fallbacks": c.counters.fallbacks,
            "carry_addresses": len(addr)}
        if copy_outputs:
            res["guard_us"] = guard_cost(c, xs[0], prompt, call)
    return res


def cfm_part(depth, chunks):
    from cadence_fx import adapters
    from cadence_fx.models.token2wav import CFMStep, build_cfm, prime_cfm
    step = CFMStep(build_cfm(depth, device="cuda"))
    spks, prompt = prime_cfm(step, device="cuda")
    g = torch.Generator().manual_seed(9)
    turn = [50] * (chunks // 2 - 1) + [56]
    widths = turn * 2
    xs = [(torch.randn(1, 80, w, generator=g).cuda(), torch.zeros(1, 80, w, device="cuda"))
          for w in widths]
    resets = {0, len(xs) // 2}
    call = lambda s, a, state: s(a[0], spks, a[1], state)  # noqa: E731
    stream(step, xs, prompt, resets, call, autocast=True)        # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    stock, st_times, st_addr = stream(step, xs, prompt, resets, call, autocast=True)
    stock_peak = torch.cuda.max_memory_allocated()
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
    c = cadence_fx.compile(step, adapter)
    t0 = time.perf_counter()
    first, first_times, _ = stream(c, xs, prompt, resets, call, autocast=True)
    compile_stream_s = time.perf_counter() - t0
    warm = (c.counters.replays, c.counters.fallbacks)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ours, times, addr = stream(c, xs, prompt, resets, call, autocast=True)
    peak = torch.cuda.max_memory_allocated()
    traces = [e.traced.seconds for e in c.classes.values()]
    return {
        "depth": depth, "chunks": len(xs), "widths": widths, "turn_resets": sorted(resets),
        "stock": {**summary(st_times), "peak_bytes": stock_peak, "state_addresses": len(st_addr)},
        "cadence": {**summary(times), "peak_bytes": peak, "carry_addresses": len(addr),
                    "bit_exact_chunks": sum(equal(a, b) for a, b in zip(stock, ours)),
                    "bit_exact_first_pass": sum(equal(a, b) for a, b in zip(stock, first)),
                    "replays_steady": c.counters.replays - warm[0],
                    "fallbacks_steady": c.counters.fallbacks - warm[1],
                    "counters": c.counters.as_dict(),
                    "classes": len(c.classes), "trace_seconds": [round(t, 2) for t in traces],
                    "capture_seconds": round(c.backend.capture_seconds, 3),
                    "graphs_captured": c.backend.captured,
                    "staging_bytes": c.backend.staging_bytes,
                    "first_pass_seconds": round(compile_stream_s, 2),
                    "carry_shape": list(c.carries["estimator_att_cache"].tensor.shape)},
        "speedup_p50": round(median(st_times) / median(times), 3),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=12)
    ap.add_argument("--skip-cfm", action="store_true")
    args = ap.parse_args()
    commit = os.environ.get("CADENCE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "python": platform.python_version(), "commit": commit,
              "toy": toy_part(args.chunks)}
    print(json.dumps(result["toy"], indent=1), flush=True)
    if not args.skip_cfm:
        result["cfm"] = cfm_part(args.depth, args.chunks)
        print(json.dumps(result["cfm"], indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
