"""What the stale-state check costs on the replay path.

A compiled call checks that a state which is a view of the carry is the one the last call handed
out (a retry from an uncloned older state raises ``GuardError`` instead of reading overwritten
frames). This measures, in one process, interleaved: the check itself (``Carry.is_stale`` on the
state the previous call returned), and whole compiled calls of the toy stream with the check as
shipped and with it switched off. On CUDA the calls replay device graphs; on the CPU they replay
through the CPU stand-in backend (``cadence_fx/replay_stand_in.py``), so the figure is the
host-side cost either way.

    python bench/stale_check.py [--device cuda] [--calls 2000] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import cadence_fx
from cadence_fx.passes.context import Carry
from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy


def _stats(xs):
    xs = sorted(xs)
    return {"p50_us": round(statistics.median(xs) * 1e6, 3),
            "p95_us": round(xs[int(0.95 * (len(xs) - 1))] * 1e6, 3)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    dev = torch.device(a.device)
    backend = None
    if dev.type == "cpu":
        from cadence_fx.replay_stand_in import StandInBackend
        backend = StandInBackend()
    model = PromptRetainedToy().to(dev)
    with torch.no_grad():
        _, prompt = model(torch.randn(1, 24, 64, device=dev), None)
    prompt = {k: v.clone() for k, v in prompt.items()}
    step = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER, backend=backend)
    x = torch.randn(1, 8, 64, device=dev)
    state = prompt
    with torch.no_grad():
        for _ in range(4):          # grow to the full window: the steady class from here on
            _, state = step(x, state)
    carry = step.carries["att"]
    shipped = Carry.is_stale
    timed = {"on": [], "off": []}
    check = []
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with torch.no_grad():
        for i in range(a.calls):
            t0 = time.perf_counter()
            carry.is_stale(state["att"])
            check.append(time.perf_counter() - t0)
            mode = "on" if i % 2 == 0 else "off"
            Carry.is_stale = shipped if mode == "on" else (lambda self, t: False)
            sync()
            t0 = time.perf_counter()
            _, state = step(x, state)
            sync()
            timed[mode].append(time.perf_counter() - t0)
    Carry.is_stale = shipped
    k = step.counters
    result = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "calls": a.calls,
        "replays": k.replays, "fallbacks": k.fallbacks,
        "is_stale": _stats(check),
        "call_with_check": _stats(timed["on"]), "call_without_check": _stats(timed["off"]),
    }
    result["p50_difference_us"] = round(result["call_with_check"]["p50_us"]
                                        - result["call_without_check"]["p50_us"], 3)
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
