"""The benchmark suite on one GPU: the ablation, the peers and the floor, in one process and run.

    python bench/suite.py --out bench/results/<date>-h200.json [--configs E,SRc,F,S,R,Rc,V,B,T,TM]
                          [--parts cfm,whole,moshi] [--depth 16] [--chunks 12]

Model: the real Token2Wav CFM loop (``CFMStep``: ``CausalConditionalCFM.forward_chunk`` + the
retention of ``stepaudio2/token2wav.py``; DiT depth 16, 10 Euler steps, CFG 0.7, random weights),
302-frame prompt state, two turns of 50-frame chunks each ending with a 56-frame call, under
``autocast("cuda", float32)`` as the stock loop runs it. Configurations:

* E: stock eager. S: state rule only (carries, rewritten graph run eagerly, no device graphs).
* R: replay only: device graphs over the stock state, staged (copied in) every call.
* Rc: replay with the stock-sized state bound by address (``Options.alias_state``).
* F: SRc with exact fusion (``passes/fuse_exact.py``, on by default: the shipped product); SRc
  and the ablation rows below run without it.
* SRc: both rules (``release_envelopes=True``: the stock envelope is freed). It runs
  first among the cadence configurations, so its warm-up pass is the cold compile of the catalog;
  the others reuse its traces (``trace_cache``) where their signatures match (keeping them copies
  each traced graph inside that cold compile, so a run with one cadence configuration keeps none).
* T / TM: ``torch.compile(mode="reduce-overhead" / "max-autotune")`` of the same step (TM runs in a
  subprocess under a time limit).
* V: the vendor's CUDA-graph branch as shipped (``CausalConditionalCFM.scatter_cuda_graph``:
  buckets 30/48/96). B: the same branch re-bucketed to the live widths 50/56 (padded to 500 cached
  frames, as the vendor pads).

Per configuration: per-chunk p50/p95 over ``--blocks`` timed passes of the stream (CUDA events,
after a warm-up pass), the paired 95% bootstrap interval of the per-chunk latency ratio against E,
peak memory over a memory pass of its own (``max_memory_allocated``, ``memory_reserved``: the whole
process, model included), its kernel time and kernels per chunk (``kernel_ms``, ``kernels``: sum
of GPU kernel durations and kernel count, profiler, kernels inside replayed graphs included) beside
``floor_ms`` (E's kernel time: the stock floor) and launches per chunk, compile and capture time, replays and fallbacks, and blocks bit-exact
against E (``torch.equal`` on mel and state, every chunk, on the device). docs/benchmarks.md
has the details. ``whole``: the whole Token2Wav chunk (flow + HiFT) E vs SRc. ``moshi``: E, V, cadence
(``bench/moshi_frame.py``).

The suite's modules, by what they measure:

* ``suite_measure``: the CFM stream and the passes of one configuration (timing, memory, floor,
  bit-exactness);
* ``suite_cfm``: the CFM part, E then the cadence ablation (S, R, Rc, SRc) and the peers, and TM;
* ``suite_peers``: the peers, the vendor's CUDA graphs (V, B) and ``torch.compile`` (T);
* ``suite_whole``: the whole Token2Wav chunk, flow + HiFT;
* ``suite_moshi``: the Moshi frame, in a child process;
* this file: the command line and the result file.
"""
from __future__ import annotations

import json
import logging
import sys
import time

import torch

from common import parser, run_info, write_result
from suite_cfm import cfm_part
from suite_measure import BLOCKS, ROW_KEYS
from suite_moshi import moshi_part
from suite_whole import whole_part

__all__ = ["log_to_stderr", "main"]

log = logging.getLogger(__name__)

# the suite's loggers: progress lines on stderr, "[HH:MM:SS] message"
_LOGGERS = (__name__, "suite_measure", "suite_cfm", "suite_peers", "suite_whole")


def log_to_stderr():
    """Progress lines of the suite's modules on stderr with the time of day; other libraries'
    logging is left as it is."""
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name("bench-suite")
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if any(h.get_name() == "bench-suite" for h in logger.handlers):
            continue   # already set up (a second call)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _parser():
    ap = parser(__doc__, depth=16, chunks=12)
    ap.add_argument("--configs", default="E,SRc,F,S,R,Rc,V,B,T,TM",
                    help="in this order; the first cadence configuration traces cold (SRc: its "
                         "warm_pass_s is the cold compile of the catalog), later ones reuse traces")
    ap.add_argument("--parts", default="cfm,whole,moshi")
    ap.add_argument("--blocks", type=int, default=BLOCKS, help="timed passes over the stream")
    ap.add_argument("--tm-timeout", type=int, default=300)
    ap.add_argument("--t-timeout", type=int, default=0,
                    help="run T in a subprocess under this wall-clock limit (s); 0: in process")
    ap.add_argument("--t-mode", default="reduce-overhead", help="torch.compile mode of T")
    ap.add_argument("--t-target", default="step", choices=("step", "estimator"),
                    help="what T compiles first (the estimator is the fallback either way)")
    ap.add_argument("--no-floor", default="", help="configurations not profiled, e.g. R,Rc,V")
    return ap


def main():
    args = _parser().parse_args()
    log_to_stderr()
    configs = args.configs.split(",")
    result = run_info(cuda=torch.version.cuda,
                      deterministic_kernels="cfm: no; whole_chunk: yes (both sides)")
    t0 = time.perf_counter()
    parts = args.parts.split(",")

    def write():
        write_result(args.out, result)

    def save(cfm):
        result["cfm"] = cfm
        for name, row in cfm.items():   # the flat per-configuration view
            if isinstance(row, dict) and "status" in row:
                result[name] = {k: row.get(k) for k in ROW_KEYS}
        write()

    if "cfm" in parts:
        save(cfm_part(args, configs, save))
    for part, key, run in (("whole", "whole_chunk", whole_part), ("moshi", "moshi", moshi_part)):
        if part in parts:   # a part that fails is recorded, and the suite goes on
            log.info(key.replace("_", " "))
            try:
                result[key] = run(args)
            except Exception as ex:  # noqa: BLE001
                result[key] = {"status": f"failed: {type(ex).__name__}: {ex}"}
            write()
    result["wall_s"] = time.perf_counter() - t0
    write()
    print(json.dumps({k: v for k, v in result.items() if k in ROW_KEYS or len(k) <= 3}, indent=1))


if __name__ == "__main__":
    main()
