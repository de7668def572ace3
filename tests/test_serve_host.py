"""The serving process's own hygiene (``cadence_fx/serve/host.py``): start-up's objects frozen
out of later collections, every collection's pause recorded, the event loop's lateness sampled.
Each test can fail: a frozen heap that later collections still walk, a pause not recorded, a
blocked loop not seen."""
import asyncio
import gc
import time

from cadence_fx.serve.host import GcPauses, LoopLag, freeze_start_up, percentiles


class _Node:
    def __init__(self):
        self.me = self   # a cycle: only the collector frees it


def test_start_ups_objects_are_frozen_out_of_later_collections():
    start_up = [_Node() for _ in range(200_000)]   # a compiled model's long-lived objects
    try:
        with GcPauses() as before:
            gc.collect()
        frozen = freeze_start_up()
        assert frozen >= len(start_up) and gc.get_freeze_count() == frozen
        with GcPauses() as after:
            gc.collect()
        # a full collection walks what traffic made, not the frozen heap
        assert after.ms_max < before.ms_max / 2, (before.report(), after.report())
        garbage = [_Node() for _ in range(10)]
        del garbage
        assert gc.collect() >= 10   # what is made after the freeze is still collected
    finally:
        gc.unfreeze()   # the rest of the test process collects as before
    assert gc.get_freeze_count() == 0


def test_every_collection_is_recorded_with_its_generation():
    pauses = GcPauses().install()
    try:
        gc.collect(0)
        gc.collect()
    finally:
        pauses.uninstall()
    assert pauses not in gc.callbacks
    report = pauses.report()
    assert report["gc_collections"] >= 2 and report["gc_full_collections"] >= 1
    assert report["gc_ms_total"] >= report["gc_ms_max"] > 0
    assert [g for _, g in pauses.pauses][-2:] == [0, 2]
    gc.collect()
    assert pauses.report()["gc_collections"] == report["gc_collections"]   # uninstalled


def test_the_loop_lag_sees_a_blocked_loop():
    lag = LoopLag(period_ms=2.0)

    async def run():
        lag.start()
        lag.start()   # once: a second call starts nothing
        await asyncio.sleep(0.05)
        time.sleep(0.08)   # what holds the loop: a request's work run on it, the GIL elsewhere
        await asyncio.sleep(0.05)

    asyncio.run(run())
    report = lag.report()

    stopped = LoopLag(period_ms=1.0, keep=None)

    async def briefly():
        stopped.start()
        await asyncio.sleep(0.03)
        await stopped.stop()
        taken = len(stopped.samples)
        await asyncio.sleep(0.03)
        return taken

    taken = asyncio.run(briefly())
    assert taken > 0 and len(stopped.samples) == taken   # stop() ends the sampling
    assert report["loop_lag_ms_max"] >= 60, report
    assert report["loop_lag_ms_p50"] < 20, report   # the other wake-ups were on time
    assert LoopLag().report() == {"loop_lag_ms_p50": None, "loop_lag_ms_p99": None,
                                  "loop_lag_ms_max": None}


def test_percentiles_by_nearest_rank():
    assert percentiles([]) == (None, None)
    assert percentiles(range(101)) == (50, 99)
    assert percentiles([3.0]) == (3.0, 3.0)


def test_stats_never_walk_the_frozen_heap(monkeypatch):
    """``gc.get_freeze_count`` walks every frozen object holding the GIL (~235 ms for a
    Token2Wav replica): the report gives the count taken at the freeze instead."""
    start_up = [_Node() for _ in range(1000)]
    try:
        frozen = freeze_start_up()

        def walk():
            raise AssertionError("the report walked the frozen heap (gc.get_freeze_count)")
        monkeypatch.setattr(gc, "get_freeze_count", walk)
        assert GcPauses().report()["gc_frozen_objects"] == frozen >= len(start_up)
    finally:
        monkeypatch.undo()
        gc.unfreeze()
