"""Many Token2Wav conversations on one GPU: stock eager vs cadence_fx session pools, side by side.

    python bench/sessions.py --out sessions.json [--ns 1,2,4,8,16,32] [--rounds 10] [--budget-ms 900]
        [--depth 16]

A session is one Token2Wav stream (flow: conformer encoder + CFM with retention; then HiFT),
its own prompt state, a turn reset in the middle. N sessions are served round-robin, one chunk
each per round, in arrival order, on one GPU. A 28-token chunk is 50 mel frames = 1 s of audio,
so N sessions are real-time when every round (the time between a session's consecutive chunks),
the slowest included, stays well inside 1 s: within the budget (``--budget-ms``, default 900 ms,
which keeps a tenth of the second for the rest of the audio path).

Stock: every session keeps its own cache dicts (cloned after each chunk: the stock step hands out
views of shared scratch buffers). cadence_fx: one compiled flow and one compiled HiFT, one
``SessionPool`` each, every session owning only its snapshots. Once a stock round takes longer
than ``--stock-max-round-ms`` (3 s), stock is far from real-time and serving more sessions only
lengthens its rounds, so from there it measures only the N of ``--past-ns`` (1, 2, 4, 8, 16, 32),
with ``--past-rounds`` rounds (4, turn reset included); every row records its rounds.

Per N and path: per-chunk p50/p95 over all sessions and per session, round p50/p95 and the slowest
round, whether it stayed within the budget (``realtime``) and within 1 s (``within_1s``),
aggregate chunks per second, memory allocated with N sessions resident (after the rounds) and its
growth per added session. Deterministic kernels are pinned on both sides (stock HiFT is not
reproducible without them); every session samples from its own generator (seeded 1000 + its
index, swapped in around its chunks on both paths), and session 0's PCM at every N is compared bit
for bit with session 0 run alone through the stock path for as many rounds.

``--churn`` serves sessions that come and go instead (``bench/sessions_churn.py``): every
``--arrive-every`` rounds one session retires and a new speaker, primed inline with its own
prompt, takes its slot; the result goes under ``churn`` (defaults there: ``--ns
1,2,4,8,12,14,16``, ``--rounds 12``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import cadence_fx
from cadence_fx.models.token2wav import (FlowStep, HiFTStep, build_flow, build_hift,
                                         empty_hift_cache, prime_flow)
from common import DEADLINE_MS, p95

BUDGET_MS = 900.0      # "well inside" the deadline (--budget-ms)
DEVICE = "cuda"        # --device cpu: a harness check only (bench/suite_smoke.py sessions)


def chunk_inputs(n_sessions, rounds, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 6561, (1, 28), generator=g).to(DEVICE) for _ in range(rounds)]
            for _ in range(n_sessions)]


def serve(n, rounds, reset, chunk):
    """Round-robin over ``n`` sessions: ``reset(s)`` at the turn boundary (mid-stream),
    ``chunk(s, r, last) -> pcm`` per session and round. Returns per-chunk and per-round ms and
    session 0's PCM."""
    half = rounds // 2
    chunk_ms, round_ms, pcm0 = [], [], []
    for r in range(rounds):
        last = r in (half - 1, rounds - 1)
        t_round = torch.cuda.Event(enable_timing=True)
        t_round.record()
        for s in range(n):
            if r == half:
                reset(s)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with torch.inference_mode():
                pcm = chunk(s, r, last)
            end.record()
            torch.cuda.synchronize()
            chunk_ms.append(start.elapsed_time(end))
            if s == 0:
                pcm0.append(pcm.cpu())
        end_round = torch.cuda.Event(enable_timing=True)
        end_round.record()
        torch.cuda.synchronize()
        round_ms.append(t_round.elapsed_time(end_round))
    return chunk_ms, round_ms, pcm0


def serve_stock(flow, hift, spk, prompt, tokens, rounds):
    """The stock step with per-session state dicts (eager)."""
    n = len(tokens)
    states = [{k: v.clone() for k, v in prompt.items()} for _ in range(n)]
    caches = [empty_hift_cache(DEVICE) for _ in range(n)]
    gen = torch.cuda.default_generators[0] if DEVICE == "cuda" else torch.default_generator
    rngs = []
    for s in range(n):   # each session samples from its own generator, as a session pool does
        gen.manual_seed(1000 + s)
        rngs.append(gen.get_state())

    def reset(s):
        states[s] = {k: v.clone() for k, v in prompt.items()}
        caches[s] = empty_hift_cache(DEVICE)

    def chunk(s, r, last):
        gen.set_state(rngs[s])
        with torch.autocast(DEVICE, dtype=torch.float32, enabled=DEVICE == "cuda"):
            mel, state = flow(tokens[s][r], spk, states[s], last_chunk=last)
        pcm, cache = hift(mel, caches[s], last_chunk=last)
        rngs[s] = gen.get_state()
        # the stock step returns views of its scratch buffers: each session keeps a copy
        states[s] = {k: v.clone() for k, v in state.items()}
        caches[s] = {k: v.clone() for k, v in cache.items()}
        return pcm

    return (*serve(n, rounds, reset, chunk), (states, caches))   # held: memory with N resident


def serve_pools(cflow, chift, spk, prompt, tokens, rounds):
    """One session pool per compiled step; each session owns its snapshots and generator."""
    n = len(tokens)
    fpool, hpool = cadence_fx.SessionPool(cflow), cadence_fx.SessionPool(chift)
    ids = [(fpool.open(prompt), hpool.open(empty_hift_cache(DEVICE), seed=1000 + s)) for s in range(n)]

    def reset(s):
        fpool.reset(ids[s][0], prompt)
        hpool.reset(ids[s][1], empty_hift_cache(DEVICE))

    def chunk(s, r, last):
        with torch.autocast(DEVICE, dtype=torch.float32, enabled=DEVICE == "cuda"):
            mel, _ = fpool.step(ids[s][0], tokens[s][r], spk, last_chunk=last)
        return hpool.step(ids[s][1], mel, last_chunk=last)[0]

    return (*serve(n, rounds, reset, chunk), (fpool, hpool))


def summarize(chunk_ms, round_ms, n, wall_s):
    per_session = [chunk_ms[s::n] for s in range(n)]   # chunk_ms is round-major
    return {"sessions": n, "chunk_p50_ms": statistics.median(chunk_ms), "chunk_p95_ms": p95(chunk_ms),
            "session_p50_ms": [statistics.median(x) for x in per_session],
            "session_p95_ms": [p95(x) for x in per_session],
            "round_p50_ms": statistics.median(round_ms), "round_p95_ms": p95(round_ms),
            "chunks_per_s": len(chunk_ms) / (sum(round_ms) / 1e3),
            "round_max_ms": max(round_ms), "realtime": max(round_ms) <= BUDGET_MS,
            "within_1s": max(round_ms) < DEADLINE_MS,
            "memory_allocated": torch.cuda.memory_allocated(),
            "max_memory_allocated": torch.cuda.max_memory_allocated(), "wall_s": wall_s}


def main():
    global DEVICE, BUDGET_MS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ns", default=None,
                    help="session counts (default 1,2,3,4,6,8,10,12,14,16,20,24,32; with --churn "
                         "1,2,4,8,12,14,16)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per N (default 10; --churn 12)")
    ap.add_argument("--churn", action="store_true",
                    help="sessions retire and new speakers arrive, each primed inline with its own "
                         "prompt (bench/sessions_churn.py); results under 'churn'")
    ap.add_argument("--arrive-every", type=int, default=3,
                    help="--churn: one session retires and a new speaker arrives every this many rounds")
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--stock-max-round-ms", type=float, default=3000.0,
                    help="once a stock round takes this long, the stock path measures only the N "
                         "of --past-ns, with --past-rounds rounds")
    ap.add_argument("--past-ns", default="1,2,4,8,16,32",
                    help="the N the stock path still measures past --stock-max-round-ms")
    ap.add_argument("--past-rounds", type=int, default=4,
                    help="rounds per N past --stock-max-round-ms (still with the turn reset)")
    ap.add_argument("--budget-ms", type=float, default=BUDGET_MS,
                    help="a session count is real-time when every round finishes within this")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if not 0 < args.budget_ms <= DEADLINE_MS:
        ap.error(f"--budget-ms {args.budget_ms} must lie in (0, {DEADLINE_MS:.0f}]: a chunk is "
                 f"{DEADLINE_MS:.0f} ms of audio")
    DEVICE, BUDGET_MS = args.device, args.budget_ms
    if args.ns is None:
        args.ns = "1,2,4,8,12,14,16" if args.churn else "1,2,3,4,6,8,10,12,14,16,20,24,32"
    if args.rounds is None:
        args.rounds = 12 if args.churn else 10
    past_ns = {int(n) for n in args.past_ns.split(",") if n}
    if not 2 <= args.past_rounds <= args.rounds:
        ap.error(f"--past-rounds {args.past_rounds} must lie in [2, --rounds {args.rounds}]: a "
                 f"stream needs a round on each side of its turn reset")
    cadence_fx.pin_deterministic_kernels()
    ns = [int(n) for n in args.ns.split(",")]
    flow = FlowStep(build_flow(args.depth, device=DEVICE))
    hift = HiFTStep(build_hift(device=DEVICE))
    if args.churn:
        return churn_main(args, flow, hift)
    spk, prompt = prime_flow(flow, device=DEVICE)
    tokens = chunk_inputs(max(ns), args.rounds)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": os.environ.get("CADENCE_COMMIT", "unknown"), "depth": args.depth,
              "rounds": args.rounds, "deterministic_kernels": True,
              "realtime_budget_ms": BUDGET_MS, "deadline_ms": DEADLINE_MS, "stock": [], "cadence": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    serve_stock(flow, hift, spk, prompt, tokens[:1], args.rounds)      # warm-up
    alone = {}   # rounds -> session 0 alone (the turn reset sits mid-stream, so per length)
    for rounds in {args.rounds, args.past_rounds}:
        alone[rounds] = serve_stock(flow, hift, spk, prompt, tokens[:1], rounds)[2]
    base = torch.cuda.memory_allocated()

    def grow(path, serve_n, counts=None, stop_ms=float("inf")):
        """One row per N; what ``serve_n`` returns last (state or pools) stays held while the
        row reads memory. Once a round takes longer than ``stop_ms``, only the N of ``past_ns``
        are measured, with ``--past-rounds`` rounds."""
        rounds = args.rounds
        for n in ns:
            if rounds != args.rounds and n not in past_ns:
                continue
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            chunk_ms, round_ms, pcm0, held = serve_n(tokens[:n], rounds)
            row = summarize(chunk_ms, round_ms, n, time.perf_counter() - t0)
            row["rounds"] = rounds
            row["session0_bit_exact_vs_alone"] = (
                len(pcm0) == rounds and all(torch.equal(a, b) for a, b in zip(alone[rounds], pcm0)))
            row.update(counts(held) if counts else {})
            result[path].append(row)
            del held
            save()
            print(path, json.dumps(row), flush=True)
            if max(round_ms) > stop_ms:
                rounds = args.past_rounds

    grow("stock", lambda toks, rounds: serve_stock(flow, hift, spk, prompt, toks, rounds),
         stop_ms=args.stock_max_round_ms)
    cflow = cadence_fx.compile(flow, "minicpmo-token2wav-flow", release_envelopes=True)
    chift = cadence_fx.compile(hift, "minicpmo-token2wav-hift")

    def serve_cadence(toks, rounds):
        return serve_pools(cflow, chift, spk, prompt, toks, rounds)

    t0 = time.perf_counter()
    serve_cadence(tokens[:1], args.rounds)      # compiles the catalog
    result["cadence_compile_s"] = time.perf_counter() - t0
    grow("cadence", serve_cadence, counts=lambda pools: {
        "swaps": pools[0].swaps + pools[1].swaps,
        "fallbacks": cflow.counters.fallbacks + chift.counters.fallbacks})
    for path in ("stock", "cadence"):
        rows = result[path]
        ok = [r["sessions"] for r in rows if r["realtime"]]
        result[f"{path}_realtime_sessions"] = max(ok) if ok else 0
        inside = [r["sessions"] for r in rows if r["within_1s"]]
        result[f"{path}_sessions_within_1s"] = max(inside) if inside else 0
        if len(rows) > 1:
            a, b = rows[0], rows[-1]
            result[f"{path}_bytes_per_added_session"] = (
                (b["memory_allocated"] - a["memory_allocated"]) / max(1, b["sessions"] - a["sessions"]))
    result["base_memory_allocated"] = base
    save()
    print(json.dumps({k: v for k, v in result.items() if k not in ("stock", "cadence")}, indent=1))


def churn_main(args, flow, hift):
    """``--churn``: the churn rows go under ``churn`` of ``--out``; a result file already there
    (the plain mode's) keeps its keys."""
    import sessions_churn
    result = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
    for k, v in {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "commit": os.environ.get("CADENCE_COMMIT", "unknown"), "depth": args.depth,
                 "deterministic_kernels": True}.items():
        result.setdefault(k, v)

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    sessions_churn.run(args, flow, hift, result, save, DEVICE, BUDGET_MS)


if __name__ == "__main__":
    sys.exit(main())
