"""The tools that turn benchmark runs into the committed result: merging suite processes,
checking the targets, putting the Moshi row into the lanes result. Pure JSON logic, no device."""
import json
import os
import random
import sys

import pytest

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import common  # noqa: E402
import lanes_merge  # noqa: E402
import suite_merge  # noqa: E402
import suite_report  # noqa: E402


def _row(p50, exact=8, floor=None, **extra):
    return {"p50_ms": p50, "p95_ms": p50 * 1.1, "peak_bytes": 2**30, "reserved_bytes": 2**30,
            "bit_exact_blocks": exact, "blocks": 8, "replays": 0, "fallbacks": 0,
            "floor_ms": floor, "status": "ok", **extra}


def _run(commit, **rows):
    return {"gpu": "H200", "torch": "2.11", "commit": commit,
            "cfm": {"model": "CFMStep", "chunks": 12, **rows}}


def test_merge_takes_each_configuration_from_the_last_process_that_finished_it():
    first = _run("a", E=_row(500.0, floor=52.0), SRc=_row(61.0), B=_row(79.0))
    second = _run("b", E=_row(400.0), SRc=_row(59.0, ratio_vs_E_mean=0.15),
                  R={"status": "failed: killed"})
    merged = suite_merge.merge([("p1", first), ("p2", second)], ["TM=not run: no device time"])
    cfm = merged["cfm"]
    assert cfm["E"]["process"] == "p1" and cfm["E"]["p50_ms"] == 500.0   # E: the first process
    assert cfm["SRc"]["process"] == "p2" and cfm["SRc"]["E_p50_ms_same_process"] == 400.0
    assert cfm["B"]["process"] == "p1"
    assert cfm["R"]["status"] == "failed: killed"          # never finished: the attempt says why
    assert merged["TM"]["status"] == "not run: no device time" and merged["TM"]["p50_ms"] is None
    assert set(merged["SRc"]) == set(suite_merge.ROW_KEYS)   # the flat view has exactly the keys
    assert merged["commits"] == {"p1": "a", "p2": "b"}
    assert set(merged["cfm_by_process"]) == {"p1", "p2"}


def test_merge_cli_rejects_an_input_without_a_label(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(_run("a", E=_row(1.0))))
    with pytest.raises(SystemExit):
        suite_merge.main(["--out", str(tmp_path / "m.json"), str(path)])


def test_targets_say_met_and_missed_from_the_numbers():
    result = {"cfm": {
        "E": _row(500.0, floor=52.0, peak_bytes=10, reserved_bytes=10),
        "SRc": _row(60.0, floor=52.0, peak_bytes=4, reserved_bytes=7, E_p50_ms_same_process=500.0,
                    warm_pass_s=90.0, trace_s=60.0, capture_s=4.0, classes=4),
        "T": _row(50.0, exact=0), "B": _row(79.0)}}
    got = {t: ok for t, _, ok in suite_report.targets(result)}
    assert got["SRc p50 <= 1.08x its kernel floor"] is False          # 60 / 52 = 1.15
    assert got["SRc p50 <= T p50, SRc bit-exact"] is False
    assert got[">= 1.3x faster than B"] is True                       # 79 / 60 = 1.32
    assert got[">= 2.8x faster than E (same process)"] is True
    assert got["SRc max_memory_allocated <= 0.60x E"] is True          # 0.4
    assert got["SRc memory_reserved <= 0.60x E"] is False              # 0.7
    assert got["cold compile of the CFM classes (trace + passes + capture) <= 30 s"] is False
    result["cfm"]["SRc"]["bit_exact_blocks"] = 7                       # not bit-exact: never met
    result["cfm"]["T"]["p50_ms"] = 70.0
    got = {t: ok for t, _, ok in suite_report.targets(result)}
    assert got["SRc p50 <= T p50, SRc bit-exact"] is False


def test_report_writes_the_table_with_every_configuration(tmp_path):
    merged = suite_merge.merge([("p1", _run("a", E=_row(500.0, floor=52.0), SRc=_row(60.0)))])
    table = suite_report.table(merged)
    assert "| SRc | 60.0 |" in table and "| E | 500.0 |" in table and "**Targets**" in table


def test_lanes_merge_copies_the_moshi_count_with_where_it_came_from(tmp_path):
    lanes = {"commit": "a", "cadence_realtime_sessions_churn": 24, "moshi_conversations_per_gpu": None}
    good = {"batch": 16, "lanes": 4, "conversations": 64, "tick_p50_ms": 61.0, "tick_p99_ms": 63.0,
            "tick_max_ms": 95.0, "realtime": True, "all_bit_exact": True}
    moshi = {"commit": "b", "moshi_conversations_per_gpu": 64, "all_bit_exact": True,
             "best": {"batch": 16, "lanes": 4, "tick_p99_ms": 63.0},
             "rows": [good, {"batch": 32, "lanes": 2, "error": "out of memory"}]}
    a, b = tmp_path / "lanes.json", tmp_path / "moshi-lanes-b.json"
    a.write_text(json.dumps(lanes))
    b.write_text(json.dumps(moshi))
    lanes_merge.main([str(a), str(b)])
    merged = json.loads(a.read_text())
    assert merged["moshi_conversations_per_gpu"] == 64 and merged["commit"] == "a"
    assert merged["cadence_realtime_sessions_churn"] == 24
    assert merged["moshi"]["file"] == "moshi-lanes-b.json" and merged["moshi"]["commit"] == "b"
    assert merged["moshi"]["rows"] == [good]
    b.write_text(json.dumps({"rows": []}))   # an unfinished run says what to give
    with pytest.raises(SystemExit, match="moshi_lanes.py"):
        lanes_merge.main([str(a), str(b)])


def test_busy_time_counts_each_instant_of_overlapping_kernels_once():
    assert common.busy_us([]) == 0.0
    assert common.busy_us([(0, 10), (20, 25)]) == 15.0                 # apart
    assert common.busy_us([(0, 10), (5, 12), (11, 13)]) == 13.0        # chained overlaps
    assert common.busy_us([(3, 4), (0, 10)]) == 10.0                   # one inside another
    assert common.busy_us([(0, 5), (5, 7)]) == 7.0                     # touching


def test_serve_bench_pools_its_repeats_and_reads_the_in_process_spread():
    """``bench/serve.py --repeats``: a path's repeats pooled (p99 over every chunk, real-time only
    if every round of every repeat was, counters summed, each repeat kept without its raw lists),
    one repeat kept as it is, and the in-process p99's spread between repeats at the read N."""
    import serve as serve_bench

    def rep(chunks, rounds, **extra):
        row = serve_bench.summary(chunks, rounds, 2)
        row.update(_chunk_ms=chunks, _round_ms=rounds, **extra)
        return row

    a = rep([10.0] * 99 + [100.0], [50.0, 60.0], counters={"calls": 4, "fallbacks": 0})
    b = rep([20.0] * 99 + [300.0], [70.0, 950.0], counters={"calls": 4, "fallbacks": 1})
    one = serve_bench.pooled([a])
    assert one["chunk_p99_ms"] == 10.0 and not any(k.startswith("_") for k in one)
    both = serve_bench.pooled([a, b])
    assert both["chunk_p99_ms_each"] == [10.0, 20.0]
    assert both["chunk_p99_ms"] == 20.0   # the 198th of 200 pooled chunks, by nearest rank
    assert both["chunk_p50_ms"] == 20.0 and both["sessions"] == 2
    assert both["realtime"] is False and both["round_max_ms"] == 950.0
    assert both["counters"] == {"calls": 8, "fallbacks": 1}
    assert [r["chunk_p50_ms"] for r in both["repeats"]] == [10.0, 20.0]
    assert not any(k.startswith("_") for r in both["repeats"] for k in r)
    t = rep([5.0] * 10, [40.0], _transport_ms=[1.0] * 9 + [9.0], _wait_ms=[0.5] * 10,
            _around_ms=[0.1] * 9 + [2.0])
    assert serve_bench.pooled([t, t])["transport_ms_p99"] == 9.0
    assert serve_bench.pooled([t, t])["around_ms_p99"] == 2.0
    ok = rep([10.0] * 99 + [100.0], [50.0, 60.0])
    row = {"sessions": 2, "inprocess": serve_bench.pooled([ok, dict(ok, chunk_p99_ms=35.0)]),
           "ray": serve_bench.pooled([ok, ok]), "all_bit_exact": True}
    args = type("Args", (), dict(device="cpu", gpus=1, lanes=1, clients="session",
                                 gc_freeze=True, rounds=2, repeats=2, direct=False))()
    result = serve_bench.result_of([row], args, {})
    assert result["inprocess_p99_spread_ms"] == 25.0 and result["ray_vs_inprocess_sessions"] == 1.0


def test_serve_bench_says_how_sure_an_added_p99_is():
    """``added_p99_interval``: rounds drawn again whole, both paths anew; a constant shift is
    found exactly, a noisy base gives an interval wide enough to hold small shifts, and the
    chunks of each round are kept by ``rounds_of``."""
    import serve as serve_bench
    base = [[10.0] * 8 for _ in range(12)]
    slower = [[60.0] * 8 for _ in range(12)]
    assert serve_bench.added_p99_interval(base, slower) == [50.0, 50.0]
    assert serve_bench.added_p99_interval(base, base) == [0.0, 0.0]
    # 8 rounds of 32 chunks, ~100 ms of spread: a 5 ms shift of the whole distribution is
    # inside an interval tens of ms wide on either side, as on the GPU at 32 sessions
    rng = random.Random(1)
    noisy = [[rng.gauss(500, 100) for _ in range(32)] for _ in range(8)]
    shifted = [[rng.gauss(505, 100) for _ in range(32)] for _ in range(8)]
    lo, hi = serve_bench.added_p99_interval(noisy, shifted)
    assert lo < 0.0 < 5.0 < hi and hi - lo > 40.0, (lo, hi)
    assert serve_bench.added_p99_interval(noisy, slower) == serve_bench.added_p99_interval(
        noisy, slower)   # seeded
    assert serve_bench.added_p99_interval([], slower) is None
    seen = []
    chunk_ms, round_ms, by_round = serve_bench.rounds_of(
        [["a", "b"], ["c"]], 3, lambda member, r: seen.append((member, r)))
    assert [len(chunks) for chunks in by_round] == [3, 3, 3] and len(round_ms) == 3
    assert sorted(chunk_ms) == sorted(ms for chunks in by_round for ms in chunks)
    assert sorted(seen) == sorted((m, r) for r in range(3) for m in "abc")
