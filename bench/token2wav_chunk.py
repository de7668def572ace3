"""The whole Token2Wav chunk on one GPU: flow (conformer encoder + CFM + retention) then HiFT
(with its caches, device randomness and eager istft), stock vs cadence_fx, side by side.

    python bench/token2wav_chunk.py --out chunk.json [--depth 16] [--chunks 12]

Deterministic kernels are pinned on both sides (stock HiFT is not reproducible without them).
Both paths start each pass from the same CUDA generator state. A first pass compiles (traces
and captures), and a second pass is timed with CUDA events. Mel and PCM are compared with
``torch.equal`` at every chunk.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

import cadence_fx
from cadence_fx.models.token2wav import (FlowStep, HiFTStep, build_flow, build_hift,
                                         empty_hift_cache, prime_flow)


def p95(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def run(flow, hift, spk, prompt, tokens, last, turn):
    torch.cuda.manual_seed(1234)
    out, times, state, cache = [], [], prompt, None
    for i, tok in enumerate(tokens):
        if i % turn == 0:
            state, cache = prompt, empty_hift_cache("cuda")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.inference_mode():
            with torch.autocast("cuda", dtype=torch.float32):
                mel, state = flow(tok, spk, state, last_chunk=last[i])
            pcm, cache = hift(mel, cache, last_chunk=last[i])
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        out.append((mel.cpu(), pcm.cpu()))
    return out, times


def build(depth, chunks):
    """The real flow and HiFT on CUDA, the prompt state, and a stream of two turns of 28-token
    chunks, each turn ending with a last chunk: ``(flow, hift, spk, prompt, tokens, last, turn)``."""
    flow = FlowStep(build_flow(depth, device="cuda"))
    hift = HiFTStep(build_hift(device="cuda"))
    spk, prompt = prime_flow(flow, device="cuda")
    turn = chunks // 2
    last = ([False] * (turn - 1) + [True]) * 2
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, 6561, (1, 28), generator=g).cuda() for _ in last]
    return flow, hift, spk, prompt, tokens, last, turn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=12)
    args = ap.parse_args()
    cadence_fx.pin_deterministic_kernels()
    flow, hift, spk, prompt, tokens, last, turn = build(args.depth, args.chunks)
    run(flow, hift, spk, prompt, tokens, last, turn)                    # warm-up
    stock, stock_ms = run(flow, hift, spk, prompt, tokens, last, turn)
    cflow = cadence_fx.compile(flow, "minicpmo-token2wav-flow")
    chift = cadence_fx.compile(hift, "minicpmo-token2wav-hift")
    first, _ = run(cflow, chift, spk, prompt, tokens, last, turn)
    warm = {n: (c.counters.replays, c.counters.fallbacks) for n, c in (("flow", cflow), ("hift", chift))}
    ours, ours_ms = run(cflow, chift, spk, prompt, tokens, last, turn)
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "commit": os.environ.get("CADENCE_COMMIT", "unknown"), "depth": args.depth,
        "chunks": len(tokens), "turns": 2, "deterministic_kernels": True,
        "stock_ms": {"p50": statistics.median(stock_ms), "p95": p95(stock_ms)},
        "cadence_ms": {"p50": statistics.median(ours_ms), "p95": p95(ours_ms)},
        "bit_exact_mel": sum(torch.equal(a[0], b[0]) for a, b in zip(stock, ours)),
        "bit_exact_pcm": sum(torch.equal(a[1], b[1]) for a, b in zip(stock, ours)),
        "bit_exact_first_pass": sum(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                    for a, b in zip(stock, first)),
        "flow": {**cflow.counters.as_dict(), "steady_replays": cflow.counters.replays - warm["flow"][0],
                 "steady_fallbacks": cflow.counters.fallbacks - warm["flow"][1],
                 "classes": len(cflow.classes)},
        "hift": {**chift.counters.as_dict(), "steady_replays": chift.counters.replays - warm["hift"][0],
                 "steady_fallbacks": chift.counters.fallbacks - warm["hift"][1],
                 "classes": len(chift.classes)},
    }
    result["speedup_p50"] = result["stock_ms"]["p50"] / result["cadence_ms"]["p50"]
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
