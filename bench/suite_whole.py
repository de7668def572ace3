"""The whole Token2Wav chunk in the suite (``bench/suite.py --parts whole``): flow (conformer
encoder + CFM + retention) then HiFT, stock eager (E) against cadence_fx (SRc), in this process.

Deterministic kernels are pinned on both sides (stock HiFT is not reproducible without them) and
every pass starts from the same CUDA generator state (``bench/token2wav_chunk.py``). E: one
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

import logging
import os
import statistics
import sys
import time

import torch

import cadence_fx
from suite_measure import cleanup, compile_breakdown, p95, ratio_ci

__all__ = ["whole_part"]

log = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))


def whole_part(args):
    """The whole chunk (flow + HiFT), E vs SRc, deterministic kernels on both sides,
    ``args.blocks`` timed passes each (every pass starts from the same generator state)."""
    blocks = args.blocks
    cadence_fx.pin_deterministic_kernels()   # stock HiFT is not reproducible without them
    sys.path.insert(0, HERE)
    import token2wav_chunk as tc
    flow, hift, spk, prompt, tokens, last, turn = tc.build(args.depth, args.chunks)
    cleanup()

    def timed(f, h, ref):
        torch.cuda.reset_peak_memory_stats()
        ms, exact = [], 0
        for _ in range(blocks):
            outs, t = tc.run(f, h, spk, prompt, tokens, last, turn)
            ref = ref or outs
            exact += all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ref, outs))
            ms += t
        return ref, ms, {"p50_ms": statistics.median(ms), "p95_ms": p95(ms),
                         "peak_bytes": torch.cuda.max_memory_allocated(),
                         "reserved_bytes": torch.cuda.memory_reserved(), "blocks": blocks,
                         "chunks_per_block": len(tokens), "bit_exact_blocks": exact}

    res = {}
    tc.run(flow, hift, spk, prompt, tokens, last, turn)
    ref, ref_ms, res["E"] = timed(flow, hift, None)
    res["E"].update(replays=0, fallbacks=0, status="ok")
    log.info("  E p50 %.1f ms, %d/%d blocks reproduce", res["E"]["p50_ms"],
             res["E"]["bit_exact_blocks"], blocks)
    t0 = time.perf_counter()
    cflow = cadence_fx.compile(flow, "minicpmo-token2wav-flow", release_envelopes=True)
    chift = cadence_fx.compile(hift, "minicpmo-token2wav-hift")
    tc.run(cflow, chift, spk, prompt, tokens, last, turn)
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
