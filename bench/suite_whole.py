"""The whole Token2Wav chunk in the suite (``bench/suite.py --parts whole``): flow (conformer
encoder + CFM + retention) then HiFT, stock eager (E) against cadence_fx (SRc), in this process.
Run alone, it writes that part's rows and nothing else::

    python bench/suite_whole.py --out chunk.json [--depth 16] [--chunks 12] [--blocks 8]

The stream (``build``, ``run``): two turns of 28-token chunks, each turn ending with a last
chunk, on the real flow and HiFT; ``bench/cold_compile.py --whole`` and
``bench/replay_timeline.py`` run the same one. Deterministic kernels are pinned on both sides
(stock HiFT is not reproducible without them) and every pass starts from the same CUDA generator
state. E: one
untimed pass, then ``--blocks`` timed passes. SRc: the flow compiled with
``release_envelopes=True`` and HiFT compiled, as shipped (exact fusion on, unlike the CFM part's
SRc row), one cold pass (``cold_compile_s``), then the same
timed passes, each compared with E's first block (mel and PCM, ``torch.equal``).

Memory, per configuration: ``torch.cuda.reset_peak_memory_stats`` right before the timed passes
(no ``gc.collect``/``empty_cache`` in between), ``peak_bytes = max_memory_allocated`` over those
passes and ``reserved_bytes = memory_reserved`` read after them. There is no separate memory
pass, and the whole process is counted (the stock flow and HiFT stay alive while SRc is
measured). Outputs are copied to the host at every chunk, so E's reference is not counted.
"""
from __future__ import annotations

import json
import logging
import time

import torch

import cadence_fx
from cadence_fx.models.token2wav import (FlowStep, HiFTStep, build_flow, build_hift,
                                         empty_hift_cache, prime_flow)
from common import cuda_timed, median, p95, parser, run_info, write_result
from suite_measure import BLOCKS, cleanup, compile_breakdown, ratio_ci

__all__ = ["build", "run", "whole_part"]

log = logging.getLogger(__name__)


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


def run(flow, hift, spk, prompt, tokens, last, turn):
    """One pass over the stream from the same CUDA generator state: ``(outputs, ms)``, the
    (mel, PCM) of every chunk on the host and its time by CUDA events."""
    torch.cuda.manual_seed(1234)
    out, times, state, cache = [], [], prompt, None
    for i, tok in enumerate(tokens):
        if i % turn == 0:
            state, cache = prompt, empty_hift_cache("cuda")

        def chunk():
            with torch.inference_mode():
                with torch.autocast("cuda", dtype=torch.float32):
                    mel, new_state = flow(tok, spk, state, last_chunk=last[i])
                pcm, new_cache = hift(mel, cache, last_chunk=last[i])
            return mel, new_state, pcm, new_cache

        (mel, state, pcm, cache), ms = cuda_timed(chunk)
        times.append(ms)
        out.append((mel.cpu(), pcm.cpu()))
    return out, times


def whole_part(args):
    """The whole chunk (flow + HiFT), E vs SRc, deterministic kernels on both sides,
    ``args.blocks`` timed passes each (every pass starts from the same generator state)."""
    blocks = args.blocks
    cadence_fx.pin_deterministic_kernels()   # stock HiFT is not reproducible without them
    flow, hift, spk, prompt, tokens, last, turn = build(args.depth, args.chunks)
    cleanup()

    def timed(f, h, ref):
        torch.cuda.reset_peak_memory_stats()
        ms, exact = [], 0
        for _ in range(blocks):
            outs, t = run(f, h, spk, prompt, tokens, last, turn)
            ref = ref or outs
            exact += all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ref, outs))
            ms += t
        return ref, ms, {"p50_ms": median(ms), "p95_ms": p95(ms),
                         "peak_bytes": torch.cuda.max_memory_allocated(),
                         "reserved_bytes": torch.cuda.memory_reserved(), "blocks": blocks,
                         "chunks_per_block": len(tokens), "bit_exact_blocks": exact}

    res = {}
    run(flow, hift, spk, prompt, tokens, last, turn)
    ref, ref_ms, res["E"] = timed(flow, hift, None)
    res["E"].update(replays=0, fallbacks=0, status="ok")
    log.info("  E p50 %.1f ms, %d/%d blocks reproduce", res["E"]["p50_ms"],
             res["E"]["bit_exact_blocks"], blocks)
    t0 = time.perf_counter()
    cflow = cadence_fx.compile(flow, "minicpmo-token2wav-flow", release_envelopes=True)
    chift = cadence_fx.compile(hift, "minicpmo-token2wav-hift")
    run(cflow, chift, spk, prompt, tokens, last, turn)
    cold_s = time.perf_counter() - t0
    _, ms, res["SRc"] = timed(cflow, chift, ref)
    res["SRc"].update(
        replays=cflow.counters.replays + chift.counters.replays,
        fallbacks=cflow.counters.fallbacks + chift.counters.fallbacks,
        cold_compile_s=cold_s, **compile_breakdown(cflow, chift),
        classes=len(cflow.classes) + len(chift.classes), status="ok")
    res["SRc"]["ratio_vs_E_ci95"], res["SRc"]["ratio_vs_E_mean"] = ratio_ci(ms, ref_ms)
    log.info("  SRc p50 %.1f ms, %d/%d blocks bit-exact, cold compile %.1f s",
             res["SRc"]["p50_ms"], res["SRc"]["bit_exact_blocks"], blocks, cold_s)
    res["deterministic_kernels"] = True
    cflow.close()
    chift.close()
    return res


def main(argv=None):
    ap = parser(__doc__, depth=16, chunks=12, blocks=BLOCKS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = whole_part(args)
    result = run_info(depth=args.depth, chunks=args.chunks, whole_chunk=rows,
                      speedup_p50=rows["E"]["p50_ms"] / rows["SRc"]["p50_ms"])
    print(json.dumps(result, indent=1))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
