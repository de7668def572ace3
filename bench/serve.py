"""Token2Wav sessions through Ray Serve on the GPU against the same session pool in-process.

    python bench/serve.py --out bench/results/DATE-h200-serve.json [--ns 4,8,10,12,14]
        [--rounds 6] [--gpus 1|2] [--lanes L] [--clients session|lane] [--cache-dir DIR]
        [--direct] [--switch-interval-ms MS] [--repeats R] [--no-gc-freeze]
    python bench/serve.py --out /tmp/serve.json --model toy --device cpu --ns 2 --rounds 2   # harness

Both paths serve N Token2Wav sessions (flow + HiFT, the real configuration on CUDA, every session
its own seed) round-robin, one chunk each per round: in-process through ``PoolEngine`` (the
replica's own engine, ``--lanes`` lanes: one thread per lane takes that lane's sessions in turn,
so lanes overlap as in a replica), and through the application (``build_app``, one replica per
GPU, ``--lanes`` lanes each) over the WebSocket on loopback. With ``--clients session`` (the
default) every session sends its chunks from a thread and connection of its own on both paths,
as conversations do, so one chunk's transport overlaps other chunks' device work; with
``--clients lane`` one thread per lane (per replica lane through Ray) sends its sessions' chunks
in turn. Through Ray each row also reports ``transport_ms`` p50/p99: a chunk's round trip less
the replica's own time for it (the reply's ``ms``). N is
real-time when every round, the slowest included, ends within ``--budget-ms`` (900 ms of the
1 s a chunk carries). Per N and path: chunk p50/p99 (the client's round trip through Ray), the
slowest round, real-time or not. Per row ``all_bit_exact``: every chunk of every session served
through Ray equals (``torch.equal``, mel and PCM) the same session in-process. Top level:
``ray_vs_inprocess_sessions`` (the largest real-time N through Ray over in-process, one GPU),
``added_p99_ms`` (Ray's p99 minus in-process p99 at the in-process real-time N),
``added_p99_interval_ms`` (its 95% interval, the rounds drawn again: ``added_p99_interval``;
``_direct`` for both over direct connections) and, with
``--gpus 2``, ``scaling_ratio`` (real-time N on two replicas over one). The device has no Ray:
``bench/serve_device.sh`` installs it from carried wheels first.

Where a chunk's transport goes, per row through Ray: ``wait_ms`` p50/p99 (the replies' own: from
the replica's event loop taking the request to a worker thread starting it; direct requests run
in their connection's thread and have none), ``around_ms`` p50/p99 (the replica thread's time on
the request besides the chunk's own: decoding, the session's lookup, the metrics), the replica's
collector pauses and event-loop lag over the row (``replica``: its stats, ``cadence_fx/serve/
host.py``), how the replica started (``replica_warm``: traces, cache loads), and this process's
own lateness (``client_lag_ms``: a thread waking every millisecond; the clients' threads decode
every reply here). The in-process path freezes start-up's objects as the replicas do
(``--no-gc-freeze`` leaves them, in both) and records its collector's pauses per row.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time

import torch

from cadence_fx.serve.engine import PoolEngine
from cadence_fx.serve.host import GcPauses, freeze_start_up, percentiles
from cadence_fx.serve.models import build

BUDGET_MS = 900.0


def pct(xs, q):
    return percentiles(xs, (q,))[0]


class Lateness:
    """This process's own lateness while the block runs: a thread sleeping 1 ms at a time and
    recording how late it wakes (what held the GIL, here the clients' threads)."""

    def __enter__(self):
        self.samples, self._run = [], True

        def beat():
            while self._run:
                t = time.perf_counter()
                time.sleep(0.001)
                self.samples.append((time.perf_counter() - t) * 1e3 - 1.0)

        self._thread = threading.Thread(target=beat, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._run = False
        self._thread.join()
        return False

    def report(self):
        p50, p99 = percentiles(self.samples)
        return {"p50": p50, "p99": p99, "max": max(self.samples, default=None)}


def _replica_stats(by_replica):
    """Each replica's stats (over one of its sessions): collector and event-loop figures."""
    keys = ("gc_collections", "gc_full_collections", "gc_ms_total", "gc_ms_max",
            "gc_frozen_objects", "loop_lag_ms_p50", "loop_lag_ms_p99", "loop_lag_ms_max",
            "switch_interval_ms")
    out = {}
    for replica, members in by_replica.items():
        stats = members[0][1].stats()
        out[replica] = {k: stats.get(k) for k in keys}
    return out


def _row_delta(before, after):
    """The replicas' collector figures over a row: counts and totals as differences (the
    maximum and the loop's lag as they stand after it: since start, and the last 20 s)."""
    out = {}
    for replica, a in after.items():
        b = before.get(replica, {})
        out[replica] = dict(a, **{k: a[k] - b.get(k, 0) for k in
                                  ("gc_collections", "gc_full_collections", "gc_ms_total")
                                  if a.get(k) is not None})
    return out


def summary(chunk_ms, round_ms, n):
    return {"sessions": n, "chunk_p50_ms": statistics.median(chunk_ms),
            "chunk_p99_ms": pct(chunk_ms, 0.99), "round_max_ms": max(round_ms),
            "realtime": max(round_ms) <= BUDGET_MS}


def rounds_of(groups, rounds, chunk):
    """``rounds`` rounds: in each, one thread per group sends one chunk of each of its
    sessions in turn (``chunk(member, round)``); returns each chunk's ms, each round's ms
    (the slowest group's) and each round's chunks' ms (``by_round``)."""
    by_round = [[] for _ in range(rounds)]

    def group(members, r):
        for member in members:
            start = time.perf_counter()
            chunk(member, r)
            by_round[r].append((time.perf_counter() - start) * 1e3)

    round_ms = []
    with concurrent.futures.ThreadPoolExecutor(max(1, len(groups))) as pool:
        for r in range(rounds):
            t0 = time.perf_counter()
            list(pool.map(lambda m: group(m, r), groups))
            round_ms.append((time.perf_counter() - t0) * 1e3)
    return [ms for chunks in by_round for ms in chunks], round_ms, by_round


def added_p99_interval(base, other, draws=2000, level=0.95, seed=0):
    """How sure an added p99 is: ``other``'s p99 minus ``base``'s over rounds drawn again with
    replacement (each a list of its chunks' ms, every repeat's rounds pooled), both paths drawn
    anew each time; the central ``level`` of the differences, [lo, hi]. Rounds are drawn whole:
    a round's chunks queue behind each other and are not independent. An interval that holds 5
    says that this many rounds cannot tell the added p99 from 5 ms."""
    if not base or not other:
        return None
    rng = random.Random(seed)

    def p99(rounds):
        drawn = [ms for _ in rounds for ms in rng.choice(rounds)]
        return pct(drawn, 0.99)

    diffs = sorted(p99(other) - p99(base) for _ in range(draws))
    cut = int(draws * (1 - level) / 2)
    return [diffs[cut], diffs[draws - 1 - cut]]


def inprocess(engine, model, n, rounds, clients="lane"):
    """N sessions on the engine, one thread per lane (``clients="session"``: per session); per-chunk
    ms (a chunk returns once its outputs are on the host) and every output."""
    ids = [engine.open(seed=1000 + s) for s in range(n)]
    outs = [[] for _ in range(n)]
    if clients == "session":
        groups = [[(s, sid)] for s, sid in enumerate(ids)]
    else:
        groups = [[(s, sid) for s, sid in enumerate(ids) if engine.lane_of(sid) == lane]
                  for lane in range(engine.lanes)]

    def chunk(member, r):
        s, sid = member
        outs[s].append(engine.chunk(sid, model.example(1000 + s, r), last=r == rounds - 1)[0])

    with GcPauses() as pauses:
        chunk_ms, round_ms, by_round = rounds_of([g for g in groups if g], rounds, chunk)
    for sid in ids:
        engine.close(sid)
    row = summary(chunk_ms, round_ms, n)
    row["gc"] = {k: v for k, v in pauses.report().items() if k != "gc_frozen_objects"}
    row.update(_chunk_ms=chunk_ms, _round_ms=round_ms, _by_round=by_round)
    return row, outs


def through_ray(url, model, n, rounds, lanes, clients="lane", direct=False):
    """N sessions over the WebSocket, ``lanes`` client threads per replica, each round-robin
    over its share of the replica's sessions (``clients="session"``: a thread per session, each
    on its connection); round time is the slowest thread's. ``direct``: the sessions' chunks go
    over connections to their replicas' own servers (``cadence_fx/serve/direct.py``)."""
    from cadence_fx.serve import StreamClient
    by_replica, sessions = {}, []
    for s in range(n):
        sess = StreamClient(url).open(seed=1000 + s, direct=direct)
        by_replica.setdefault(sess.replica, []).append((s, sess))
        sessions.append(sess)
    ping_ms = []   # a stats request's round trip: the path without a chunk's work or payload
    for _ in range(20):
        start = time.perf_counter()
        sessions[0].stats()
        ping_ms.append((time.perf_counter() - start) * 1e3)
    if clients == "session":
        groups = [[member] for members in by_replica.values() for member in members]
    else:
        groups = [members[i::lanes] for members in by_replica.values() for i in range(lanes)]
    outs = [[] for _ in range(n)]

    transport_ms, wait_ms, around_ms = [], [], []

    def chunk(member, r):
        s, sess = member
        inputs = model.example(1000 + s, r)
        start = time.perf_counter()
        outs[s].append(sess.chunk(last=r == rounds - 1, **inputs))
        transport_ms.append((time.perf_counter() - start) * 1e3 - sess.last_reply["ms"])
        if "wait_ms" in sess.last_reply:
            wait_ms.append(sess.last_reply["wait_ms"])
        if "around_ms" in sess.last_reply:
            around_ms.append(sess.last_reply["around_ms"])

    before = _replica_stats(by_replica)
    with Lateness() as client:
        chunk_ms, round_ms, by_round = rounds_of([g for g in groups if g], rounds, chunk)
    after = _replica_stats(by_replica)
    for sess in sessions:
        sess.close()
        sess.client.close()
    row = summary(chunk_ms, round_ms, n)
    row["transport_ms_p50"] = statistics.median(transport_ms)
    row["transport_ms_p99"] = pct(transport_ms, 0.99)
    row["wait_ms_p50"], row["wait_ms_p99"] = percentiles(wait_ms)
    row["around_ms_p50"], row["around_ms_p99"] = percentiles(around_ms)
    row["ping_ms_p50"] = statistics.median(ping_ms[5:])
    row["client_lag_ms"] = client.report()
    row["replica"] = _row_delta(before, after)
    row["replica_warm"] = {sess.replica: sess.warm for sess in sessions}
    row.update(_chunk_ms=chunk_ms, _round_ms=round_ms, _by_round=by_round,
               _transport_ms=transport_ms,
               _wait_ms=wait_ms, _around_ms=around_ms)
    return row, outs


def pooled(reps):
    """One path's row over its repeats: chunk, round, transport and wait figures over every
    repeat's chunks (real-time only if every round of every repeat was), each repeat's p99, and
    each repeat's own row (``repeats``); one repeat's row as it is."""
    clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in reps]
    if len(reps) == 1:
        return clean[0]
    every = lambda key: [x for r in reps for x in r.get(key, [])]   # noqa: E731
    row = summary(every("_chunk_ms"), every("_round_ms"), reps[0]["sessions"])
    row["chunk_p99_ms_each"] = [r["chunk_p99_ms"] for r in reps]
    if "_transport_ms" in reps[0]:
        row["transport_ms_p50"], row["transport_ms_p99"] = percentiles(every("_transport_ms"))
        row["wait_ms_p50"], row["wait_ms_p99"] = percentiles(every("_wait_ms"))
        row["around_ms_p50"], row["around_ms_p99"] = percentiles(every("_around_ms"))
    if "counters" in reps[0]:
        row["counters"] = {k: sum(r["counters"][k] for r in reps) for k in reps[0]["counters"]}
    row["repeats"] = clean
    return row


def exact(a, b):
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
               for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def start_ray(name, gpus, cache_dir, port, lanes, direct=False, switch_interval_ms=None,
              gc_freeze=True):
    import ray
    from ray import serve
    from cadence_fx.serve import build_app
    from cadence_fx.serve.launch import inline_replies
    inline_replies()   # a Token2Wav reply (112 KB) handed over inline, not through the store
    ray.init(num_gpus=gpus, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(name, max(gpus, 1), cache_dir=cache_dir, num_gpus=1 if gpus else 0,
                        lanes=lanes, direct_host="127.0.0.1" if direct else None,
                        switch_interval_ms=switch_interval_ms, gc_freeze=gc_freeze),
              name="bench", route_prefix="/")
    return f"ws://127.0.0.1:{port}/v1/stream"


def largest(rows, key):
    return max((r["sessions"] for r in rows if r[key]["realtime"]), default=0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ns", default="4,8,10,12,14")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--gpus", type=int, default=1, choices=[1, 2])
    ap.add_argument("--lanes", type=int, default=1,
                    help="lanes per pool, in-process and in each replica (default 1)")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default="token2wav", help="toy: the harness check on the CPU")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--clients", choices=["lane", "session"], default="session",
                    help="session: every session sends from a thread (and connection) of its own, "
                         "as conversations do, on both paths; lane: one thread per lane sends "
                         "its sessions' chunks in turn (a chunk's transport then delays the next)")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval in this process (the in-process path) and in "
                         "each replica (default: Python's 5 ms)")
    ap.add_argument("--direct", action="store_true",
                    help="also measure each row over direct connections to the replicas "
                         "(rows' ray_direct; docs/serving.md, Direct connections)")
    ap.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                    help="leave start-up's objects to the collector in this process and in the "
                         "replicas (default: frozen once warm, as a replica does)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="each N's paths this many times in turn, pooled (the in-process p99's "
                         "spread between repeats says what an added p99 can be told from)")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: run each path at least once")
    if args.switch_interval_ms is not None:   # the in-process path as the replicas
        from cadence_fx.serve.host import process_settings
        process_settings(None, args.switch_interval_ms)
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="cfx-serve-")
    model = build(args.model, args.device, cache_dir)
    engine = PoolEngine(model, lanes=args.lanes)
    warm = engine.warm()          # fills the cache the replicas start from
    if args.gc_freeze:            # as each replica does once warm
        warm["gc_frozen_objects"] = freeze_start_up()
    ns = [int(n) for n in args.ns.split(",")]
    url = start_ray(args.model, args.gpus if args.device == "cuda" else 0, cache_dir, args.port,
                    args.lanes, args.direct, args.switch_interval_ms, args.gc_freeze)
    rows = []
    for n in ns:   # the result is written after every row: a run cut short keeps what it measured
        paths = {"inprocess": [], "ray": [], **({"ray_direct": []} if args.direct else {})}
        all_exact = True
        for _ in range(args.repeats):   # the paths in turn, so a drift in the host's load
            before = engine.counters()  # falls on each of them
            local, local_outs = inprocess(engine, model, n, args.rounds, args.clients)
            # what the in-process row ran: compiled calls and replays, any fallback to stock
            local["counters"] = {k: v - before[k] for k, v in engine.counters().items()}
            paths["inprocess"].append(local)
            for path in paths:
                if path != "inprocess":
                    remote, remote_outs = through_ray(url, model, n, args.rounds, args.lanes,
                                                      args.clients, direct=path == "ray_direct")
                    paths[path].append(remote)
                    all_exact = all_exact and exact(local_outs, remote_outs)
        rounds = {path: [r for rep in reps for r in rep.get("_by_round", [])]
                  for path, reps in paths.items()}
        rows.append({"sessions": n, **{path: pooled(reps) for path, reps in paths.items()},
                     "gpus": args.gpus, "lanes": args.lanes, "repeats": args.repeats,
                     "all_bit_exact": all_exact,
                     # the added p99's 95% interval, rounds drawn again (added_p99_interval)
                     "added_p99_interval_ms": {
                         path: added_p99_interval(rounds["inprocess"], rounds[path])
                         for path in paths if path != "inprocess"}})
        print(json.dumps(rows[-1]), flush=True)
        with open(args.out, "w") as f:
            json.dump(result_of(rows, args, warm), f, indent=1)


def result_of(rows, args, warm):
    best_local, best_ray = largest(rows, "inprocess"), largest(rows, "ray")
    at = next((r for r in rows if r["sessions"] == best_local), rows[0])
    return {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
            "commit": os.environ.get("CADENCE_COMMIT", "unknown"), "gpus": args.gpus,
            "lanes": args.lanes, "clients": args.clients, "gc_freeze": args.gc_freeze,
            "switch_interval_ms": sys.getswitchinterval() * 1e3,
            "rounds": args.rounds, "repeats": args.repeats, "budget_ms": BUDGET_MS, "warm": warm, "rows": rows,
            "inprocess_realtime_sessions": best_local, "ray_realtime_sessions": best_ray,
            "ray_vs_inprocess_sessions": best_ray / best_local if best_local else None,
            "added_p99_ms": at["ray"]["chunk_p99_ms"] - at["inprocess"]["chunk_p99_ms"],
            "added_p99_interval_ms": at.get("added_p99_interval_ms", {}).get("ray"),
            # how far the in-process p99 moved between its own repeats: what an added p99
            # smaller than this cannot be told from (None with one repeat)
            "inprocess_p99_spread_ms": (max(at["inprocess"]["chunk_p99_ms_each"])
                                        - min(at["inprocess"]["chunk_p99_ms_each"])
                                        if "chunk_p99_ms_each" in at["inprocess"] else None),
            "all_bit_exact": all(r["all_bit_exact"] for r in rows),
            **({"direct_vs_inprocess_sessions": largest(rows, "ray_direct") / best_local
                if best_local else None,
                "added_p99_ms_direct": at["ray_direct"]["chunk_p99_ms"]
                - at["inprocess"]["chunk_p99_ms"],
                "added_p99_interval_ms_direct": at.get("added_p99_interval_ms", {}).get(
                    "ray_direct")} if args.direct else {}),
            # two replicas through Ray against the one-GPU pool in-process
            **({"scaling_ratio": best_ray / best_local if best_local else None}
               if args.gpus == 2 else {}),
            "date": datetime.date.today().isoformat()}


if __name__ == "__main__":
    main()
