"""The cold compile of the Token2Wav CFM catalog, on its own, in a fresh process.

    python bench/cold_compile.py --out cold.json [--whole] [--depth 16] [--chunks 12]

Builds the suite's CFM stream (``bench/suite.py``: DiT depth 16, two turns of 50-frame chunks each
ending with a 56-frame call: 4 classes), compiles the step as the suite's SRc does
(``release_envelopes=True``, no shared traces), and times one pass over the stream: every class
traced, rewritten, probed and captured on first sight, the other chunks replayed. Reports the
pass's seconds with its breakdown (``trace_s``, ``copied_calls``, ``passes_s``, ``probe_s``,
``capture_s``, ``warmup_s``), and, as a gauge of the host's speed (tracing is Python on the host,
and a shared host's speed varies between runs), the median stock eager chunk over 6 chunks
measured first. Run it for several builds alternately to compare them on one host.

``--whole``: the whole Token2Wav catalog instead, as the suite's ``whole`` part compiles it (flow:
encoder + CFM + retention, and HiFT; ``bench/suite_whole.py``'s stream, deterministic kernels
pinned): every class of both compiled steps, cold.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, parser, run_info, write_result  # noqa: E402
from suite_measure import CFMStream, compile_breakdown  # noqa: E402

import cadence_fx  # noqa: E402
from cadence_fx import adapters  # noqa: E402


def whole(args):
    import suite_whole as tc   # the whole chunk stream (build, run)
    cadence_fx.pin_deterministic_kernels()   # as the suite's whole part (stock HiFT needs them)
    flow, hift, spk, prompt, tokens, last, turn = tc.build(args.depth, args.chunks)
    tc.run(flow, hift, spk, prompt, tokens, last, turn)   # library set-up, not timed
    _, stock = tc.run(flow, hift, spk, prompt, tokens, last, turn)
    cflow = cadence_fx.compile(flow, "minicpmo-token2wav-flow", release_envelopes=True)
    chift = cadence_fx.compile(hift, "minicpmo-token2wav-hift")
    t0 = time.perf_counter()
    tc.run(cflow, chift, spk, prompt, tokens, last, turn)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, stock, len(tokens), [cflow, chift]


def main():
    ap = parser(__doc__, depth=16, chunks=12)
    ap.add_argument("--whole", action="store_true", help="the whole catalog: flow and HiFT")
    args = ap.parse_args()
    if args.whole:
        cold, stock, chunks, compiled = whole(args)
    else:
        stream = CFMStream(args.depth, args.chunks)
        stock = []
        stream.run(stream.step, limit=2)   # library set-up, not timed
        stream.run(stream.step, stock, limit=6)
        adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
        compiled = [cadence_fx.compile(stream.step, adapter, release_envelopes=True)]
        t0 = time.perf_counter()
        stream.run(compiled[0])
        torch.cuda.synchronize()
        cold, chunks = time.perf_counter() - t0, len(stream.xs)
    row = run_info(package=cadence_fx.__file__,
                   catalog="whole (flow + HiFT)" if args.whole else "CFM", depth=args.depth,
                   chunks=chunks, stock_chunk_p50_ms=median(stock), cold_pass_s=cold,
                   classes=sum(len(c.classes) for c in compiled),
                   replays=sum(c.counters.replays for c in compiled),
                   fallbacks=sum(c.counters.fallbacks for c in compiled),
                   **compile_breakdown(*compiled))
    write_result(args.out, row)
    print(json.dumps(row))


if __name__ == "__main__":
    sys.exit(main())
