"""A CPU check of the benchmark harnesses before spending device time:

    python bench/suite_smoke.py [suite|sessions]

Runs ``bench/suite.py``'s CFM part (``suite_cfm.cfm_part``: E, SRc, S, R, Rc) at DiT depth 1
over 4 chunks on the CPU, with the CUDA timing and memory calls stubbed (events by
``perf_counter``, memory 0) and autocast off. Latencies and memory here mean nothing; what it
checks is that every configuration runs through the harness and that the harness's comparison
sees them bit-exact. V, B, T and TM need CUDA graphs or a GPU compiler and are not run.
``sessions`` runs ``bench/sessions.py`` (stock vs session pools, N = 1, 2, depth 1, 4 rounds) the
same way and checks that session 0 comes out bit-exact against itself alone on both paths; then
its ``--churn`` mode (N = 1, 2, depth 2, 4 rounds, a new speaker every 2), checking that every
session, retired or not, is bit-exact against its speaker alone on both paths, that the compiled
steps ran, and that priming on the compiled flow lent the envelopes and left them released.
``churn`` runs only the churn part."""
import sys, time, types
import torch
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))

class Ev:
    def __init__(self, enable_timing=False): self.t = None
    def record(self): self.t = time.perf_counter()
    def elapsed_time(self, other): return (other.t - self.t) * 1e3
torch.cuda.Event = Ev
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
torch.cuda.max_memory_allocated = lambda *a, **k: 0
torch.cuda.memory_allocated = lambda *a, **k: 0
torch.cuda.memory_reserved = lambda *a, **k: 0
torch.cuda.empty_cache = lambda *a, **k: None
torch.cuda.get_device_name = lambda *a, **k: "cpu-smoke"
_autocast = torch.autocast
torch.autocast = lambda device_type, **k: _autocast("cpu", enabled=False)

def churn_smoke():
    """``bench/sessions.py --churn`` on the CPU; returns the problems found."""
    import json, os, tempfile
    import sessions  # noqa: E402 - after the stubs
    out = os.path.join(tempfile.mkdtemp(), "churn.json")
    # stock is measured at both N (--stock-max-round-ms: CPU rounds are slow)
    sys.argv = ["sessions.py", "--churn", "--out", out, "--device", "cpu", "--depth", "2",
                "--ns", "1,2", "--rounds", "4", "--arrive-every", "2", "--stock-max-round-ms", "1e12"]
    sessions.main()
    res = json.load(open(out))
    churn = res.get("churn", {})
    rows = churn.get("stock", []) + churn.get("cadence", [])
    bad = [f"no {k}" for k in ("stock_realtime_sessions_churn", "cadence_realtime_sessions_churn")
           if k not in res]
    bad += [f"{p} N = {r['sessions']}: {r['sessions_bit_exact']}/{r['sessions_checked']} bit-exact"
            for p in ("stock", "cadence") for r in churn.get(p, []) if not r["all_bit_exact"]]
    bad += [f"cadence N = {r['sessions']}: compiled_calls {r['compiled_calls']}, fallbacks "
            f"{r['fallbacks']} {r['fallback_reasons']}" for r in churn.get("cadence", [])
            if r["compiled_calls"] <= 0]
    bad += [f"cadence N = {r['sessions']}: {r['primes_lent']} primes lent for {r['arrivals']} arrivals"
            for r in churn.get("cadence", []) if r["primes_lent"] < r["arrivals"]]
    if not churn.get("released_bytes"):
        bad.append(f"released_bytes {churn.get('released_bytes')} at the end")
    bad += [f"{r['sessions']}: priming outside the round" for r in rows if not r["priming_inside_round"]]
    if [r["sessions"] for r in rows] != [1, 2, 1, 2] or [r["arrivals"] for r in rows] != [1, 1, 1, 1]:
        bad.append(f"rows {[(r['sessions'], r['arrivals']) for r in rows]}, expected N 1, 2, 1, 2 "
                   "with one arrival each")
    return bad


if sys.argv[1:] == ["churn"]:
    bad = churn_smoke()
    print("churn harness ok" if not bad else f"churn harness problems: {bad}")
    sys.exit(1 if bad else 0)

if sys.argv[1:] == ["sessions"]:
    import json, os, tempfile
    import sessions  # noqa: E402 - after the stubs
    out = os.path.join(tempfile.mkdtemp(), "sessions.json")
    # CPU rounds are slow: N = 1, 2; stock passes --stock-max-round-ms at once, so its N = 2 row
    # takes the past-the-deadline path (--past-rounds rounds)
    sys.argv = ["sessions.py", "--out", out, "--device", "cpu", "--depth", "1", "--ns", "1,2",
                "--rounds", "4", "--stock-max-round-ms", "0", "--past-ns", "2", "--past-rounds", "2"]
    sessions.main()
    res = json.load(open(out))
    rows = res["stock"] + res["cadence"]
    bad = [(r["sessions"], r.get("fallbacks")) for r in rows if not r["session0_bit_exact_vs_alone"]]
    bad += [f"no {k}" for k in ("stock_realtime_sessions", "cadence_realtime_sessions",
                                "realtime_budget_ms") if k not in res]
    bad += [f"no round_max_ms at N = {r['sessions']}" for r in rows if "round_max_ms" not in r]
    if [r["rounds"] for r in rows] != [4, 2, 4, 4]:
        bad.append(f"rounds per row {[r['rounds'] for r in rows]}, expected [4, 2, 4, 4]")
    print("harness ok" if len(rows) == 4 and not bad else f"harness problems: {bad}, {len(rows)} rows")
    churn_bad = churn_smoke()
    print("churn harness ok" if not churn_bad else f"churn harness problems: {churn_bad}")
    sys.exit(1 if bad or churn_bad or len(rows) != 4 else 0)

import suite  # noqa: E402 - after the stubs
import suite_cfm  # noqa: E402

suite.log_to_stderr()
args = types.SimpleNamespace(depth=1, chunks=4, blocks=2, no_floor="", t_mode="reduce-overhead",
                             tm_timeout=5, t_target="step")
res = {}
out = suite_cfm.cfm_part(args, ["E", "SRc", "S", "R", "Rc"], res.update, device="cpu")
for k, v in out.items():
    if isinstance(v, dict) and "status" in v:
        print(k, {x: v.get(x) for x in ("p50_ms", "bit_exact_blocks", "blocks", "replays", "fallbacks", "status", "classes", "traces")})
bad = [k for k, v in out.items() if isinstance(v, dict) and "status" in v
       and (v["status"] != "ok" or v.get("bit_exact_blocks") != v.get("blocks"))]
print("harness ok" if not bad else f"harness problems: {bad}")
sys.exit(1 if bad else 0)
