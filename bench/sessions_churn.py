"""Session churn for ``bench/sessions.py --churn``: speakers arrive and retire while others stream.

    python bench/sessions.py --churn --out sessions.json [--ns 1,2,4,8,12,14,16] [--rounds 12]
        [--arrive-every 3] [--budget-ms 900] [--depth 16]

N slots are served round-robin for R rounds, one chunk per slot and round, as in the plain mode.
Every K rounds (``--arrive-every``) one slot's session retires and a new speaker arrives in that
slot: the arrival number j (rounds K, 2K, ... before R) takes slot (j - 1) mod N. A retiring
session's final chunk is its ``last_chunk`` call (its turn ends, the 56-frame call flushes the
look-ahead); then it is closed. The new speaker is primed inline, at its slot's turn in that
round, with its own prompt: ``prime_flow(seed=speaker)`` gives different tokens, mel and speaker
embedding per speaker. Stock primes on the stock module; cadence_fx primes on the compiled
flow's module, whose ``flow.setup_cache`` is the adapter's declared priming method: it borrows
the released envelopes for the call and releases them again. Priming time is inside the round,
as a server primes; a round is real-time when it finishes within the budget, priming included.
The slots' first speakers (0 .. N - 1) are primed before the first round and not timed in it.

Speakers keep their identity across N: slot s starts with speaker s, arrival j is speaker
100 + j. A speaker's chunks are its own (seeded by its id), and its generator is seeded
1000 + id on both paths. Every session, retired or still streaming at the end, is compared with
``torch.equal`` (mel and PCM, every chunk) with the same speaker run alone through the stock path:
one alone stream per speaker, as long as its longest session over all N, and for each length at
which a session of that speaker retires, a copy of the alone stream's state at that point runs the
``last_chunk`` call. Surviving sessions stop mid-stream (no last chunk).

Everything stock (the alone references, then the stock rows) runs before the flow is compiled
with ``release_envelopes=True``: the compiled flow guards the stock module's envelope readers.
Stock stops growing N once one of its rounds exceeds ``--stock-max-round-ms``.
"""
from __future__ import annotations

import collections
import gc
import json
import statistics
import time

import torch

import cadence_fx
from cadence_fx.models.token2wav import empty_hift_cache, prime_flow
from common import DEADLINE_MS, p95

FIRST_ARRIVAL = 100   # arrival j is speaker FIRST_ARRIVAL + j
SHAPE_CAP = 3         # chunk classes depend on a session's chunk index only up to index 2


def schedule(n, rounds, every):
    """Sessions of one churn run: dicts with speaker, slot, start (round), chunks, retired."""
    live = {s: {"speaker": s, "slot": s, "start": 0} for s in range(n)}
    done = []
    for j, r in enumerate(range(every, rounds, every), 1):
        slot = (j - 1) % n
        old = live[slot]
        done.append(dict(old, chunks=r - old["start"], retired=True))
        live[slot] = {"speaker": FIRST_ARRIVAL + j, "slot": slot, "start": r}
    done += [dict(s, chunks=rounds - s["start"], retired=False) for s in live.values()]
    return done


def generator(device):
    return torch.cuda.default_generators[0] if device == "cuda" else torch.default_generator


def seeded_rng(device, seed):
    gen = generator(device)
    outside = gen.get_state()
    gen.manual_seed(seed)
    start = gen.get_state()
    gen.set_state(outside)
    return start


class StockSession:
    """One speaker on the stock path: its own state dicts (cloned after every chunk: the stock
    step hands out views of shared scratch buffers) and its own generator state."""

    def __init__(self, flow, hift, spk, prompt, speaker, device):
        self.flow, self.hift, self.spk, self.prompt, self.device = flow, hift, spk, prompt, device
        self.state = {k: v.clone() for k, v in prompt.items()}
        self.cache = empty_hift_cache(device)
        self.rng = seeded_rng(device, 1000 + speaker)

    def step(self, token, last):
        gen = generator(self.device)
        gen.set_state(self.rng)
        with torch.autocast(self.device, dtype=torch.float32, enabled=self.device == "cuda"):
            mel, state = self.flow(token, self.spk, self.state, last_chunk=last)
        pcm, cache = self.hift(mel, self.cache, last_chunk=last)
        self.rng = gen.get_state()
        self.state = {k: v.clone() for k, v in state.items()}
        self.cache = {k: v.clone() for k, v in cache.items()}
        return mel, pcm

    def fork(self):
        other = object.__new__(StockSession)
        other.__dict__.update(self.__dict__)
        other.state = {k: v.clone() for k, v in self.state.items()}
        other.cache = {k: v.clone() for k, v in self.cache.items()}
        other.rng = self.rng.clone()
        return other


class StockPath:
    def __init__(self, flow, hift, device):
        self.flow, self.hift, self.device = flow, hift, device

    def open(self, speaker):
        spk, prompt = prime_flow(self.flow, seed=speaker, device=self.device)
        return StockSession(self.flow, self.hift, spk, prompt, speaker, self.device)

    def step(self, session, token, last):
        return session.step(token, last)

    def close(self, session):
        pass

    def counters(self):
        return {}


class PoolPath:
    """One session pool per compiled step; a new speaker is primed on the compiled module."""

    def __init__(self, cflow, chift, device):
        self.cflow, self.chift, self.device = cflow, chift, device
        self.fpool, self.hpool = cadence_fx.SessionPool(cflow), cadence_fx.SessionPool(chift)
        self.start = self.snapshot()

    def snapshot(self):
        f, h = self.cflow.counters, self.chift.counters
        return {"compiled_calls": f.compiled_calls + h.compiled_calls,
                "fallbacks": f.fallbacks + h.fallbacks, "primes_lent": f.primes_lent,
                "reasons": f.reasons + h.reasons}

    def open(self, speaker):
        spk, prompt = prime_flow(self.cflow.module, seed=speaker, device=self.device)
        fid = self.fpool.open(prompt, seed=1000 + speaker)
        hid = self.hpool.open(empty_hift_cache(self.device), seed=1000 + speaker)
        return spk, prompt, fid, hid   # the prompt stays held, as a server keeps it for resets

    def step(self, session, token, last):
        spk, _, fid, hid = session
        with torch.autocast(self.device, dtype=torch.float32, enabled=self.device == "cuda"):
            mel, _ = self.fpool.step(fid, token, spk, last_chunk=last)
        return mel, self.hpool.step(hid, mel, last_chunk=last)[0]

    def close(self, session):
        self.fpool.close(session[2])
        self.hpool.close(session[3])

    def counters(self):
        now = self.snapshot()
        reasons = now["reasons"] - self.start["reasons"]
        return {"compiled_calls": now["compiled_calls"] - self.start["compiled_calls"],
                "fallbacks": now["fallbacks"] - self.start["fallbacks"],
                "fallback_reasons": dict(reasons),
                "primes_lent": now["primes_lent"] - self.start["primes_lent"],
                "released_bytes": self.cflow.counters.released_bytes,
                "swaps": self.fpool.swaps + self.hpool.swaps}


def timed(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    with torch.inference_mode():
        out = fn()
    end.record()
    torch.cuda.synchronize()
    return out, start.elapsed_time(end)


def run_churn(path, n, rounds, every, tokens_of):
    """One churn run over ``n`` slots; returns the timings and every session's mel/PCM (host)."""
    sessions = schedule(n, rounds, every)
    arriving = {(s["slot"], s["start"]): s for s in sessions if s["start"] > 0}
    live, initial_ms = {}, []
    for s in sessions:
        if s["start"] == 0:
            s["handle"], ms = timed(lambda: path.open(s["speaker"]))
            initial_ms.append(ms)
            live[s["slot"]] = s
    chunk_ms, round_ms, priming_ms, priming_rounds = [], [], [], []
    for r in range(rounds):
        t_round = torch.cuda.Event(enable_timing=True)
        t_round.record()
        for slot in range(n):
            new = arriving.get((slot, r))
            if new is not None:   # the slot's speaker retired last round; the new one primes now
                path.close(live[slot].pop("handle"))
                new["handle"], ms = timed(lambda: path.open(new["speaker"]))
                priming_ms.append(ms)
                priming_rounds.append(r)
                live[slot] = new
            s = live[slot]
            i = r - s["start"]
            last = s["retired"] and i == s["chunks"] - 1
            (mel, pcm), ms = timed(lambda: path.step(s["handle"], tokens_of(s["speaker"])[i], last))
            chunk_ms.append(ms)
            s.setdefault("mel", []).append(mel.cpu())
            s.setdefault("pcm", []).append(pcm.cpu())
        end_round = torch.cuda.Event(enable_timing=True)
        end_round.record()
        torch.cuda.synchronize()
        round_ms.append(t_round.elapsed_time(end_round))
    return sessions, chunk_ms, round_ms, priming_ms, priming_rounds, initial_ms


def needs(ns, rounds, every):
    """Per speaker: the length of its alone stream without a last chunk, and the lengths at which
    one of its sessions retires (a ``last_chunk`` call at index length - 1)."""
    main, forks = collections.defaultdict(int), collections.defaultdict(set)
    for n in ns:
        for s in schedule(n, rounds, every):
            k = s["speaker"]
            main[k] = max(main[k], s["chunks"] - 1 if s["retired"] else s["chunks"])
            if s["retired"]:
                forks[k].add(s["chunks"])
    return {k: (main[k], sorted(forks[k])) for k in main}


def alone_references(flow, hift, device, wanted, tokens_of):
    """Each speaker alone through the stock path; returns speaker -> (chunks, {length: last})."""
    path, refs = StockPath(flow, hift, device), {}
    for speaker, (main_len, fork_lens) in sorted(wanted.items()):
        with torch.inference_mode():
            session = path.open(speaker)
            main, last = [], {}
            for i in range(max([main_len, *fork_lens])):
                if i + 1 in fork_lens:
                    mel, pcm = session.fork().step(tokens_of(speaker)[i], True)
                    last[i + 1] = (mel.cpu(), pcm.cpu())
                if i < main_len:
                    mel, pcm = session.step(tokens_of(speaker)[i], False)
                    main.append((mel.cpu(), pcm.cpu()))
        refs[speaker] = (main, last)
    return refs


def expected(refs, s):
    main, last = refs[s["speaker"]]
    if s["retired"]:
        return main[:s["chunks"] - 1] + [last[s["chunks"]]]
    return main[:s["chunks"]]


def measure(path, n, args, tokens_of, refs, budget_ms):
    """One row: churn over ``n`` slots, peak memory over the whole run, every session checked."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    at_start = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    sessions, chunk_ms, round_ms, priming_ms, priming_rounds, initial_ms = run_churn(
        path, n, args.rounds, args.arrive_every, tokens_of)
    wall_s = time.perf_counter() - t0
    resident = torch.cuda.memory_allocated()
    peak = torch.cuda.max_memory_allocated()
    checked = []
    for s in sessions:
        ref = expected(refs, s)
        mel_ok = len(ref) == len(s["mel"]) and all(torch.equal(a[0], b) for a, b in zip(ref, s["mel"]))
        pcm_ok = len(ref) == len(s["pcm"]) and all(torch.equal(a[1], b) for a, b in zip(ref, s["pcm"]))
        checked.append({k: s[k] for k in ("speaker", "slot", "start", "chunks", "retired")}
                       | {"mel_bit_exact": mel_ok, "pcm_bit_exact": pcm_ok})
        if "handle" in s:
            path.close(s.pop("handle"))
    steady = [ms for r, ms in enumerate(round_ms) if r not in priming_rounds]
    primed = [round_ms[r] for r in sorted(set(priming_rounds))]
    row = {"sessions": n, "rounds": args.rounds, "arrive_every": args.arrive_every,
           "arrivals": len(priming_ms), "priming_inside_round": True,
           "chunk_p50_ms": statistics.median(chunk_ms), "chunk_p95_ms": p95(chunk_ms),
           "round_ms": round_ms, "round_p50_ms": statistics.median(round_ms),
           "round_p95_ms": p95(round_ms), "round_max_ms": max(round_ms),
           "round_max_with_priming_ms": max(primed, default=None),
           "round_max_without_priming_ms": max(steady, default=None),
           "realtime": max(round_ms) <= budget_ms, "within_1s": max(round_ms) < DEADLINE_MS,
           "chunks_per_s": len(chunk_ms) / (sum(round_ms) / 1e3),
           "priming_ms": priming_ms, "priming_p50_ms": statistics.median(priming_ms) if priming_ms else None,
           "priming_max_ms": max(priming_ms, default=None),
           "initial_priming_p50_ms": statistics.median(initial_ms),
           "memory_allocated_at_start": at_start, "memory_allocated": resident,
           "max_memory_allocated": peak, "wall_s": wall_s,
           "sessions_checked": len(checked),
           "sessions_bit_exact": sum(c["mel_bit_exact"] and c["pcm_bit_exact"] for c in checked),
           "session_results": checked}
    row["all_bit_exact"] = row["sessions_bit_exact"] == len(checked)
    row.update(path.counters())
    return row


def warm_up(path, ns, args, tokens_of):
    """Compile every class the churn runs reach: one session per distinct (length up to
    SHAPE_CAP, retired) shape; chunk classes stop changing after index SHAPE_CAP - 1."""
    shapes = sorted({(min(s["chunks"], SHAPE_CAP), s["retired"])
                     for n in ns for s in schedule(n, args.rounds, args.arrive_every)})
    for chunks, retired in shapes:
        with torch.inference_mode():
            handle = path.open(0)
            for i in range(chunks):
                path.step(handle, tokens_of(0)[i], retired and i == chunks - 1)
        path.close(handle)
    return shapes


def run(args, flow, hift, result, save, device, budget_ms):
    """The churn mode: fills ``result["churn"]`` (saved after every row) and the summary keys."""
    ns = [int(n) for n in args.ns.split(",")]
    if not 0 < args.arrive_every < args.rounds:
        raise SystemExit(f"--arrive-every {args.arrive_every} must lie in [1, --rounds {args.rounds}):"
                         " at least one speaker must arrive")
    token_cache = {}

    def tokens_of(speaker):
        if speaker not in token_cache:
            g = torch.Generator().manual_seed(50_000 + speaker)
            token_cache[speaker] = [torch.randint(0, 6561, (1, 28), generator=g).to(device)
                                    for _ in range(args.rounds)]
        return token_cache[speaker]

    churn = result["churn"] = {
        "rounds": args.rounds, "arrive_every": args.arrive_every, "depth": args.depth,
        "realtime_budget_ms": budget_ms, "deadline_ms": DEADLINE_MS,
        "priming_inside_round": True, "last_chunk_on_retire": True,
        "priming": "prime_flow(seed=speaker): stock on the stock module, cadence on the compiled "
                   "flow's module (flow.setup_cache lends the released envelopes)",
        "stock_max_round_ms": args.stock_max_round_ms, "stock": [], "cadence": []}
    wanted = needs(ns, args.rounds, args.arrive_every)
    t0 = time.perf_counter()
    refs = alone_references(flow, hift, device, wanted, tokens_of)
    churn["references"] = {"speakers": len(refs), "wall_s": time.perf_counter() - t0,
                           "chunks": sum(m + len(f) for m, f in wanted.values())}
    save()
    stock = StockPath(flow, hift, device)
    for n in ns:
        row = measure(stock, n, args, tokens_of, refs, budget_ms)
        churn["stock"].append(row)
        save()
        print("churn stock", json.dumps({k: v for k, v in row.items() if k not in ("session_results", "round_ms")}), flush=True)
        if row["round_max_ms"] > args.stock_max_round_ms:
            churn["stock_skipped_ns"] = [m for m in ns if m > n]
            break
    cflow = cadence_fx.compile(flow, "minicpmo-token2wav-flow", release_envelopes=True)
    chift = cadence_fx.compile(hift, "minicpmo-token2wav-hift")
    t0 = time.perf_counter()
    churn["warm_up_shapes"] = warm_up(PoolPath(cflow, chift, device), ns, args, tokens_of)
    churn["cadence_compile_s"] = time.perf_counter() - t0
    for n in ns:
        row = measure(PoolPath(cflow, chift, device), n, args, tokens_of, refs, budget_ms)
        churn["cadence"].append(row)
        save()
        print("churn cadence", json.dumps({k: v for k, v in row.items() if k not in ("session_results", "round_ms")}), flush=True)
    churn["counters"] = {"flow": cflow.counters.as_dict(), "hift": chift.counters.as_dict()}
    churn["released_bytes"] = cflow.counters.released_bytes
    churn["primes_lent"] = cflow.counters.primes_lent
    churn["compiled_calls"] = cflow.counters.compiled_calls + chift.counters.compiled_calls
    churn["compiled_path_ran"] = all(r["compiled_calls"] > 0 for r in churn["cadence"])
    churn["all_sessions_bit_exact"] = all(r["all_bit_exact"] for r in churn["stock"] + churn["cadence"])
    for path in ("stock", "cadence"):
        ok = [r["sessions"] for r in churn[path] if r["realtime"]]
        churn[f"{path}_realtime_sessions_churn"] = result[f"{path}_realtime_sessions_churn"] = (
            max(ok) if ok else 0)
        inside = [r["sessions"] for r in churn[path] if r["within_1s"]]
        churn[f"{path}_sessions_within_1s_churn"] = max(inside) if inside else 0
    save()
    print(json.dumps({k: v for k, v in churn.items() if k not in ("stock", "cadence", "counters")}))
    for path in ("stock", "cadence"):   # the verdicts last: device.sh shows the log's tail
        for r in churn[path]:
            verdicts = ", ".join(
                f"speaker {c['speaker']} ({c['chunks']} chunks{', retired' if c['retired'] else ''}) "
                + ("exact" if c["mel_bit_exact"] and c["pcm_bit_exact"] else
                   "NOT exact (" + " ".join(k for k in ("mel", "pcm") if not c[f"{k}_bit_exact"]) + ")")
                for c in r["session_results"])
            print(f"churn {path} N={r['sessions']}: {r['sessions_bit_exact']}/{r['sessions_checked']} "
                  f"sessions bit-exact (mel + PCM) vs alone"
                  + (f", compiled_calls {r['compiled_calls']}, fallbacks {r['fallbacks']} "
                     f"{r['fallback_reasons']}, primes_lent {r['primes_lent']}" if path == "cadence" else "")
                  + f": {verdicts}", flush=True)
    print(f"churn: stock real-time up to N = {churn['stock_realtime_sessions_churn']}, cadence_fx "
          f"up to N = {churn['cadence_realtime_sessions_churn']} (every round, priming included, "
          f"within {budget_ms:.0f} ms); every session bit-exact: {churn['all_sessions_bit_exact']}; "
          f"compiled calls {churn['compiled_calls']}, primes lent {churn['primes_lent']}, released "
          f"bytes at the end {churn['released_bytes']}", flush=True)
