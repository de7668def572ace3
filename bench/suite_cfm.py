"""The CFM part of the suite (``bench/suite.py --parts cfm``): E first, then every other
configuration in ``--configs`` order, one after another in this process, each measured against
this process's E.

* E: stock eager; its first timed block is the reference every other configuration is compared
  with, chunk by chunk.
* The ablation, ``cadence_fx.compile`` of the same step: S (state rule only, ``graphs=False``),
  R (replay only, ``state_rule=False``), Rc (replay over stock-sized state bound by address,
  ``Options(state_rule=False, alias_state=True)``), SRc (both rules, ``release_envelopes=True``:
  the product without fusion), F (SRc with exact fusion, ``passes/fuse_exact.py``: the shipped
  default). The first of them traces cold; when there are several, the later ones reuse its
  traces (``trace_cache``).
* The peers (``suite_peers``): V, B, T; and TM, which runs T in max-autotune in a subprocess of
  its own under ``--tm-timeout``.

A configuration that fails is recorded with its error and the part goes on. After each one the
partial result is saved and one line (the flat keys) is printed on stdout.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import traceback

import cadence_fx
from cadence_fx.passes.pipeline import Options
from suite_measure import ROW_KEYS, Baseline, CFMStream, cleanup, counters_row, measure
from suite_peers import run_torch_compile, run_vendor

__all__ = ["CADENCE", "cfm_part", "run_cadence"]

log = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
CADENCE = ("S", "SRc", "F", "R", "Rc")   # the configurations compiled by cadence_fx


def run_cadence(base, name, traces, **compile_kwargs):
    """One cadence configuration: the step compiled with ``compile_kwargs`` (``traces``: the trace
    cache shared with the other cadence configurations, or None), measured, then closed."""
    from cadence_fx import adapters
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
    compiled = cadence_fx.compile(base.stream.step, adapter, trace_cache=traces, **compile_kwargs)
    try:
        _, row = base.measure(name, compiled)
        row.update(counters_row(compiled))
        row["trace_cache"] = "none" if traces is None else "shared"
        row["status"] = "ok"
        return row
    finally:
        compiled.close()
        del compiled
        cleanup()


def cfm_part(args, configs, save, device="cuda"):
    """E, then ``configs`` in order (E and TM excepted: TM runs last, in a subprocess). ``args``
    carries ``depth``, ``chunks``, ``blocks``, ``no_floor`` (comma-separated letters),
    ``t_mode``, ``t_target`` and ``tm_timeout``; ``save(res)`` is called after each row."""
    no_floor = frozenset(filter(None, args.no_floor.split(",")))
    stream = CFMStream(args.depth, args.chunks, device)
    cleanup()
    res = {"model": f"CFMStep, DiT depth {args.depth}, 10 Euler steps, CFG 0.7",
           "chunks": len(stream.xs), "widths": stream.widths, "turn_resets": sorted(stream.resets)}
    log.info("E")
    ref, e = measure(stream, stream.step, None, None, prof="E" not in no_floor, blocks=args.blocks)
    e.update(replays=0, fallbacks=0, status="ok")
    res["E"] = e
    save(res)
    base = Baseline(stream, ref, e["times_ms"], blocks=args.blocks, no_floor=no_floor,
                    floor_ms=e["floor_ms"])
    # the traces are kept for the other cadence configurations only when there are any: keeping
    # them copies every traced graph, inside the cold compile of the configuration that traced it
    traces = {} if sum(c in CADENCE for c in configs) > 1 else None
    jobs = {
        "S": lambda: run_cadence(base, "S", traces, graphs=False, fuse=False),
        "SRc": lambda: run_cadence(base, "SRc", traces, release_envelopes=True,
                                   options=Options(fuse_exact=False)),
        "F": lambda: run_cadence(base, "F", traces, release_envelopes=True),
        "R": lambda: run_cadence(base, "R", traces, state_rule=False, fuse=False),
        "Rc": lambda: run_cadence(base, "Rc", traces,
                                  options=Options(state_rule=False, alias_state=True,
                                                  fuse_exact=False)),
        "V": lambda: run_vendor(base, rebucket=False),
        "B": lambda: run_vendor(base, rebucket=True),
        "T": lambda: run_torch_compile(base, args.t_mode, args.t_target),
    }
    if getattr(args, "t_timeout", 0) and "T" in configs:   # T under a compile budget
        jobs["T"] = lambda: run_subprocess_config("T", args, args.t_mode, args.t_timeout)
    for name in configs:
        if name in ("E", "TM"):
            continue
        t0 = time.perf_counter()
        log.info("%s", name)
        try:
            res[name] = jobs[name]()
        except Exception as ex:  # noqa: BLE001 - recorded, the suite goes on
            res[name] = {"status": f"failed: {type(ex).__name__}: {str(ex).splitlines()[0][:300]}",
                         "traceback": traceback.format_exc()[-2000:]}
            cleanup()
        res[name]["config_wall_s"] = time.perf_counter() - t0
        # the suite's stdout: one line per configuration, as it finishes
        print(f"{name}: {json.dumps({k: res[name].get(k) for k in ROW_KEYS})}", flush=True)
        save(res)
    if "TM" in configs:
        res["TM"] = run_subprocess_config("TM", args, "max-autotune", args.tm_timeout)
    return res


def run_subprocess_config(name, args, mode, timeout):
    """A configuration that may not finish (torch.compile in ``mode``): its own process, a
    wall-clock limit of ``timeout`` seconds. That process measures its own E first; the row is
    its T. Past the limit the row records how long it ran without finishing."""
    out = f"/tmp/suite-{name}.json"
    cmd = [sys.executable, os.path.join(HERE, "suite.py"), "--out", out, "--parts", "cfm",
           "--configs", "E,T", "--depth", str(args.depth), "--chunks", str(args.chunks),
           "--blocks", str(args.blocks), "--t-mode", mode, "--t-target", args.t_target]
    t0 = time.perf_counter()
    try:
        subprocess.run(cmd, timeout=timeout, check=True, capture_output=True, text=True)
        with open(out) as f:
            row = json.load(f)["cfm"]["T"]
        row["note"] = f"mode={mode!r}, in a subprocess under a {timeout} s limit"
        return row
    except subprocess.TimeoutExpired:
        return {"status": f"did not finish compiling and running within {timeout} s ({mode}; "
                          "the limit includes the subprocess's own E)", "mode": mode,
                "wall_s": time.perf_counter() - t0}
    except Exception as ex:  # noqa: BLE001
        return {"status": f"failed: {type(ex).__name__}: {str(ex)[-300:]}"}
