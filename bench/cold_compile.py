"""The cold compile of the Token2Wav CFM catalog, on its own, in a fresh process.

    python bench/cold_compile.py --out cold.json [--depth 16] [--chunks 12]

Builds the suite's CFM stream (``bench/suite.py``: DiT depth 16, two turns of 50-frame chunks each
ending with a 56-frame call: 4 classes), compiles the step as the suite's SRc does
(``release_envelopes=True``, no shared traces), and times one pass over the stream: every class
traced, rewritten, probed and captured on first sight, the other chunks replayed. Reports the
pass's seconds with its breakdown (``trace_s``, ``copied_calls``, ``passes_s``, ``probe_s``,
``capture_s``, ``warmup_s``), and, as a gauge of the host's speed (tracing is Python on the host,
and a shared host's speed varies between runs), the median stock eager chunk over 6 chunks
measured first. Run it for several builds alternately to compare them on one host.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suite import CFMStream, compile_breakdown  # noqa: E402

import cadence_fx  # noqa: E402
from cadence_fx import adapters  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=12)
    args = ap.parse_args()
    stream = CFMStream(args.depth, args.chunks)
    stock = []
    stream.run(stream.step, limit=2)   # library set-up, not timed
    stream.run(stream.step, stock, limit=6)
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
    compiled = cadence_fx.compile(stream.step, adapter, release_envelopes=True)
    t0 = time.perf_counter()
    stream.run(compiled)
    torch.cuda.synchronize()
    cold = time.perf_counter() - t0
    row = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": os.environ.get("CADENCE_COMMIT", "unknown"), "package": cadence_fx.__file__,
           "depth": args.depth, "chunks": len(stream.xs), "stock_chunk_p50_ms": statistics.median(stock),
           "cold_pass_s": cold, "classes": len(compiled.classes), "replays": compiled.counters.replays,
           "fallbacks": compiled.counters.fallbacks, **compile_breakdown(compiled)}
    with open(args.out, "w") as f:
        json.dump(row, f, indent=1)
    print(json.dumps(row))


if __name__ == "__main__":
    sys.exit(main())
