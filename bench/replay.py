"""What ExactShapeReplay itself costs: stock eager vs cadence_fx on the toy stream, one GPU, in
the same run.

    python bench/replay.py --out results.json [--chunks 12]

The toy stream (``PromptRetainedToy``, 8 layers of 512, two turns each ending in a wider call):
per-chunk latency by CUDA events after a warm-up pass (p50/p95/mean), compiled with and without
``copy_outputs`` (the cost of copying outputs out of the graph's buffers), the guard's cost per
check of one captured piece, the carry's addresses, and ``torch.equal`` on every chunk. The real
Token2Wav CFM chunk, which this script measured too, is the suite's CFM part
(``bench/suite.py --parts cfm``: E against SRc, R and the rest, the carry's addresses included).
"""
from __future__ import annotations

import json
import platform
import statistics
import time

import torch

import cadence_fx
from cadence_fx.replay import GuardedPiece
from common import cuda_timed, median, p95, parser, run_info, write_result


def stream(step, chunks, prompt_state, resets, call):
    """Run ``step`` over ``chunks``; returns (outputs cloned, per-chunk ms, state addresses)."""
    outs, times, addresses, state = [], [], set(), prompt_state
    for i, args in enumerate(chunks):
        if i in resets:
            state = prompt_state

        def chunk():
            with torch.inference_mode():
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


def main():
    args = parser(__doc__, chunks=12).parse_args()
    result = run_info(cuda=torch.version.cuda, python=platform.python_version(),
                      toy=toy_part(args.chunks))
    print(json.dumps(result["toy"], indent=1), flush=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
