"""Lanes and the deadline scheduler, on the streaming decoder of tests/streaming_decoder.py.

A pool of L lanes places each session on one lane for life (the least loaded); lanes hold their
own carries and graphs, so a session's outputs, priming passes and turn resets included, are
bit-exact against the session run alone through stock whatever ran on any lane; a lane whose
captures fail runs its pieces eagerly while the other lanes replay; the scheduler serves a
bounded random workload (Poisson arrivals, random conversation lengths) with every session
checked against itself alone; the scheduler counts the classes compiled during traffic, which
``warm_lanes`` prepares beforehand (a partial flush here), and dispatches nothing to a lane whose
step compiles a priming class in the background while the other lanes go on. The CUDA test
(skipped on the CPU) replays lanes concurrently and names every output that differs."""
import asyncio
import dataclasses
import os
import pickle
import random
import threading
import time

import pytest
import torch

import cadence_fx
from cadence_fx.scheduler import Scheduler
from cadence_fx.sessions import warm_lanes
from helpers import stream
from replay_stand_in import StandInBackend
from streaming_decoder import CALL, CHUNK, DECODER_ADAPTER, PROMPT, chunks, make_decoder, prompt

ADAPTER = dataclasses.replace(DECODER_ADAPTER, prompt_lengths=(PROMPT,))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu   # on CUDA where it is there (the device's -m gpu), else the CPU


def _script(seed, n_chunks, reset_at=None):
    """One conversation: ("prime", x) then ("chunk", x) calls; a turn reset primes again."""
    g = random.Random(seed)
    widths = [g.choice([CHUNK, CHUNK, CHUNK, CALL]) for _ in range(n_chunks)]
    xs = chunks(widths, seed=1000 + seed)
    calls = [("prime", prompt(seed).clone(memory_format=torch.contiguous_format))]
    for i, x in enumerate(xs):
        if i == reset_at:
            calls.append(("prime", prompt(seed + 50).clone(memory_format=torch.contiguous_format)))
        calls.append(("chunk", x))
    return [(op, x.to(DEVICE)) for op, x in calls]


def _alone(model, script):
    outs, state = [], None
    with torch.inference_mode():
        for op, x in script:
            out, state = model(x, None if op == "prime" else state)
            outs.append(out.cpu())
    return outs


def _pool(model, lanes, backend_for_lane=None):
    compiled = cadence_fx.compile(model, ADAPTER,
                                  backend=None if backend_for_lane else
                                  (StandInBackend() if DEVICE == "cpu" else None))
    if backend_for_lane is None and DEVICE == "cpu":
        backend_for_lane = lambda i: StandInBackend()   # noqa: E731 - graphs on the CPU too
    pool = cadence_fx.SessionPool(compiled, lanes=lanes, backend_for_lane=backend_for_lane)
    with torch.inference_mode():
        _, state = model(_script(0, 0)[0][1], None)
        pool.capture_catalog(chunks([CHUNK], 1)[0].to(DEVICE), state)
    return pool


def _interleave(pool, scripts, order_seed=0):
    """Run every script through the pool, one call at a time in a random interleaving."""
    sids = [pool.open(None) for _ in scripts]
    pos, outs = [0] * len(scripts), [[] for _ in scripts]
    g = random.Random(order_seed)
    with torch.inference_mode():
        while any(p < len(s) for p, s in zip(pos, scripts)):
            i = g.choice([k for k, s in enumerate(scripts) if pos[k] < len(s)])
            op, x = scripts[i][pos[i]]
            if op == "prime" and pos[i] > 0:
                pool.reset(sids[i], None)
            outs[i].append(_read(pool, sids[i], pool.step(sids[i], x)[0]))
            pos[i] += 1
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return sids, [[o.cpu() for o in out] for out in outs]


def _read(pool, sid, t):
    """A chunk's result, cloned on the session's lane stream: on CUDA ``pool.step`` returns
    once the chunk is queued there, so a read on the caller's stream could come before it."""
    stream = pool.lanes[pool.lane_of(sid)].stream
    if stream is None:
        return t.clone()
    with torch.cuda.stream(stream):
        return t.clone()


def _mismatches(lanes, scripts, outs, model, label):
    """Every output that differs from the session alone through stock: which session, chunk,
    call, lane, shape, max |diff| and how many elements differ (empty when all are exact)."""
    found = []
    for i, (script, out) in enumerate(zip(scripts, outs)):
        want, lane = _alone(model, script), lanes[i]
        if len(out) != len(want):
            found.append(f"{label}: session {i} (lane {lane}) gave {len(out)} outputs, "
                         f"stock {len(want)}")
        for j, (a, b) in enumerate(zip(out, want)):
            if a.shape != b.shape or not torch.equal(a, b):
                diff = ((a.double() - b.double()).abs() if a.shape == b.shape else None)
                found.append(
                    f"{label}: session {i} (lane {lane}) chunk {j} ({script[j][0]}, width "
                    f"{script[j][1].shape[1]}): shape {tuple(a.shape)} vs {tuple(b.shape)}"
                    + ("" if diff is None else f", max |diff| {diff.max().item():.3e}, "
                       f"{int((diff > 0).sum())} of {diff.numel()} elements differ"))
    return found


def _lanes_report(pool) -> str:
    """What a failure on the device needs besides the diffs: streams, counters, settings."""
    lines = [f"torch {torch.__version__}, CUBLAS_WORKSPACE_CONFIG="
             f"{os.environ.get('CUBLAS_WORKSPACE_CONFIG')!r}, deterministic "
             f"{torch.are_deterministic_algorithms_enabled()}"]
    for lane in pool.lanes:
        k, backend = lane.compiled.counters, lane.compiled.backend
        side = getattr(backend, "_side", None)
        lines.append(
            f"lane {lane.index}: stream {getattr(lane.stream, 'cuda_stream', None)}, capture "
            f"stream {getattr(side, 'cuda_stream', None)}, pool {getattr(backend, 'pool', None)}, "
            f"graphs {getattr(backend, 'captured', 0)}, calls {k.calls}, replays {k.replays}, "
            f"eager pieces {k.eager_pieces}, fallbacks {k.fallbacks} {dict(k.reasons)}, "
            f"compiles in traffic {lane.compile_log}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def model():
    return make_decoder().to(DEVICE)


def _exact(got, want):
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_sessions_live_on_one_lane_each_and_lanes_keep_their_state(model):
    pool = _pool(model, lanes=3)
    scripts = [_script(s, 3 + s % 3, reset_at=2 if s % 2 else None) for s in range(7)]
    sids, outs = _interleave(pool, scripts)
    assert [pool.lane_of(s) for s in sids] == [0, 1, 2, 0, 1, 2, 0]
    for script, out in zip(scripts, outs):
        assert _exact(out, _alone(model, script))
    lanes = pool.lanes
    ptrs = [{n: c.tensor.data_ptr() for n, c in lane.compiled.carries.items()} for lane in lanes]
    assert all(ptrs[i][n] != ptrs[j][n] for i in range(3) for j in range(i) for n in ptrs[i])
    for lane in lanes:   # each lane ran its own sessions' calls, all compiled and replayed
        k = lane.compiled.counters
        calls = sum(len(sc) for sc, s in zip(scripts, sids) if pool.lane_of(s) == lane.index)
        assert (k.calls, k.compiled_calls, k.fallbacks) == (calls, calls, 0)
        assert k.replays == calls and k.carry_addresses == 1 and k.traces == 0
    memory = pool.memory()
    assert len(memory["lanes"]) == 3 and all(m["carries"] > 0 for m in memory["lanes"])
    assert set(memory["sessions"]) == set(sids)


def test_a_lane_whose_captures_fail_runs_eager_alone(model):
    backends = {}

    def backend_for_lane(i):
        backends[i] = StandInBackend(fail=RuntimeError("no room") if i == 1 else None)
        return backends[i]

    pool = _pool(model, lanes=3, backend_for_lane=backend_for_lane)
    scripts = [_script(10 + s, 3) for s in range(6)]
    _, outs = _interleave(pool, scripts, order_seed=3)
    for script, out in zip(scripts, outs):
        assert _exact(out, _alone(model, script))
    replays = [lane.compiled.counters.replays for lane in pool.lanes]
    assert replays[1] == 0 and replays[0] > 0 and replays[2] > 0
    assert backends[1].failures and not backends[0].failures and not backends[2].failures
    assert pool.lanes[1].compiled.counters.compiled_calls > 0   # compiled, pieces eager


def test_bad_lane_counts_and_placements_are_refused(model):
    compiled = cadence_fx.compile(model, ADAPTER)
    with pytest.raises(ValueError, match="positive number of lanes"):
        cadence_fx.SessionPool(compiled, lanes=0)
    pool = cadence_fx.SessionPool(compiled, lanes=2)
    with pytest.raises(ValueError, match="lanes 0..1"):
        pool.open(None, lane=2)



def _prepared_pool(model, lanes, spoil=None):
    """A pool whose lanes' ``capture_catalog`` preparations are returned with it; ``spoil``
    rewrites the shared frozen classes after lane 0 compiled them."""
    compiled = cadence_fx.compile(model, ADAPTER, backend=StandInBackend() if DEVICE == "cpu"
                                  else None)
    pool = cadence_fx.SessionPool(compiled, lanes=lanes, backend_for_lane=(
        (lambda i: StandInBackend()) if DEVICE == "cpu" else None))
    with torch.inference_mode():
        _, state = model(_script(0, 0)[0][1], None)
        example = chunks([CHUNK], 1)[0].to(DEVICE)
        preps = [pool.lanes[0].compiled.capture_catalog(example, state)]
        if spoil is not None:
            spoil(compiled.store.share_classes())
        preps += [lane.compiled.capture_catalog(example, state) for lane in pool.lanes[1:]]
    return pool, preps


def test_lanes_thaw_the_first_lanes_compiled_classes_instead_of_compiling_them(model):
    pool, preps = _prepared_pool(model, lanes=3)
    classes = len(preps[0].rows)
    assert classes > 1 and preps[0].work["traces"] == classes and preps[0].work["lane_loads"] == 0
    for prep in preps[1:]:   # no trace, no passes, no probationary call: only the capture
        assert (prep.work["traces"], prep.work["lane_loads"]) == (0, classes), str(prep)
        assert {r["how"] for r in prep.rows} == {"loaded from another lane"}
        assert all(r["graphs"] > 0 for r in prep.rows)
    frozen = pool.lanes[0].compiled.store.share_classes()
    assert set(frozen) == set(pool.lanes[0].compiled.classes) == set(pool.lanes[2].compiled.classes)
    scripts = [_script(30 + s, 4, reset_at=2 if s % 2 else None) for s in range(6)]
    sids, outs = _interleave(pool, scripts, order_seed=4)
    assert not _mismatches([pool.lane_of(s) for s in sids], scripts, outs, model, "thawed")
    for lane in pool.lanes:   # every lane replayed its own graphs, on its own carries
        k = lane.compiled.counters
        assert k.replays > 0 and k.fallbacks == 0 and k.traces == 0, _lanes_report(pool)
    ptrs = [{n: c.tensor.data_ptr() for n, c in lane.compiled.carries.items()} for lane in pool.lanes]
    assert all(ptrs[i][n] != ptrs[j][n] for i in range(3) for j in range(i) for n in ptrs[i])


def test_a_shared_class_that_does_not_load_is_compiled_by_the_lane(model, caplog):
    def spoil(frozen):
        key = next(iter(frozen))
        payload = pickle.loads(frozen[key])
        payload["module"] = dict(payload["module"], magic=b"other", src="not python (")
        frozen[key] = pickle.dumps(payload)

    with caplog.at_level("WARNING", logger="cadence_fx.class_compiler"):
        pool, preps = _prepared_pool(model, lanes=2, spoil=spoil)
    classes = len(preps[0].rows)   # the spoiled one compiled from lane 0's trace (copied)
    assert (preps[1].work["traces"], preps[1].work["lane_loads"]) == (0, classes - 1), str(preps[1])
    assert preps[1].work["trace_copies"] == 1
    assert sorted(r["how"] for r in preps[1].rows) == (
        ["compiled from another lane's trace"] + ["loaded from another lane"] * (classes - 1))
    assert set(pool.lanes[1].compiled.classes) == set(pool.lanes[0].compiled.classes)
    assert "another lane's compiled class is not loadable here (SyntaxError" in caplog.text
    scripts = [_script(40 + s, 3) for s in range(4)]
    sids, outs = _interleave(pool, scripts, order_seed=5)
    assert not _mismatches([pool.lane_of(s) for s in sids], scripts, outs, model, "spoiled")
    assert all(lane.compiled.counters.replays > 0 for lane in pool.lanes)

async def _serve(pool, scripts, seed, lanes=False, threads=False, queued_on=None):
    """Poisson arrivals; each conversation submits its calls one after the other. Returns the
    report and outputs (and with ``lanes`` each conversation's lane). ``queued_on``: a set that
    collects the names of the threads the chunks were queued from."""
    def run(sid, *args, **kwargs):
        if queued_on is not None:
            queued_on.add(threading.current_thread().name.split("_")[0])
        return pool.step(sid, *args, **kwargs)

    sched = Scheduler(pool, period_ms=5000.0, poll_ms=0.1, threads=threads, run=run)
    g = random.Random(seed)
    outs, homes = [[] for _ in scripts], [None] * len(scripts)

    async def conversation(i):
        sid = sched.open(None)
        homes[i] = pool.lane_of(sid)
        for j, (op, x) in enumerate(scripts[i]):
            if op == "prime" and j > 0:
                sched.reset(sid, None)
            out = await sched.submit(sid, x)
            outs[i].append(out[0].clone())
        await sched.drain()
        sched.close(sid)

    tasks = []
    for i in range(len(scripts)):
        await asyncio.sleep(g.expovariate(1000.0))   # arrivals at about 1 per ms
        tasks.append(asyncio.create_task(conversation(i)))
    await asyncio.gather(*tasks)
    await sched.stop()
    return (sched.report(), outs, homes) if lanes else (sched.report(), outs)


@pytest.mark.parametrize("threads", [False, True], ids=["loop-thread", "lane-threads"])
def test_scheduler_serves_a_random_workload_exactly(model, threads):
    pool = _pool(model, lanes=2)
    g = random.Random(7)
    scripts = [_script(20 + s, g.randint(1, 5), reset_at=g.choice([None, 1])) for s in range(8)]
    queued_on = set()
    report, outs = asyncio.run(_serve(pool, scripts, seed=7, threads=threads, queued_on=queued_on))
    assert queued_on == ({"cadence-lane0", "cadence-lane1"} if threads else {"MainThread"})
    for script, out in zip(scripts, outs):
        assert _exact([o.cpu() for o in out], _alone(model, script))
    assert report["chunks"] == sum(len(s) for s in scripts)
    assert report["deadline_misses"] == 0 and report["latency_p99_ms"] >= report["latency_p50_ms"]
    assert set(report["chunks_per_lane"]) == {0, 1} and not pool.sessions
    assert sum(lane.compiled.counters.fallbacks for lane in pool.lanes) == 0


def _flush_script(seed):
    """A conversation ending in a 5-frame partial flush: a class no catalog example makes."""
    return _script(seed, 3) + [("chunk", chunks([5], seed=2000 + seed)[0].to(DEVICE))]


@pytest.mark.parametrize("threads", [False, True], ids=["loop-thread", "lane-threads"])
def test_the_scheduler_counts_classes_compiled_in_traffic_and_warm_lanes_prepares_them(model,
                                                                                      threads):
    scripts = [_flush_script(60 + s) for s in range(4)]
    cold = _pool(model, lanes=2)
    report, outs = asyncio.run(_serve(cold, scripts, seed=5, threads=threads))
    assert not _mismatches([0] * 4, scripts, [[o.cpu() for o in out] for out in outs], model, "cold")
    assert report["compiles"] == 2 == cold.compiles   # the flush's class, once on each lane
    assert sorted(c["lane"] for c in report["compile_chunks"]) == [0, 1]

    warm = _pool(model, lanes=2)

    def stream(lane):
        sid = warm.open(None, lane=lane)
        for _, x in _flush_script(99):
            warm.step(sid, x)
        warm.close(sid)

    warmed = warm_lanes([warm], stream)
    assert [(w["lane"], w["compiled"], w["stock"]) for w in warmed] == [(0, 1, {}), (1, 1, {})]
    assert all(lane.compiled.counters.calls == 0 for lane in warm.lanes)   # not traffic
    report, outs = asyncio.run(_serve(warm, scripts, seed=5, threads=threads))
    assert not _mismatches([0] * 4, scripts, [[o.cpu() for o in out] for out in outs], model, "warm")
    assert report["compiles"] == 0 == warm.compiles and report["compile_chunks"] == []
    assert sum(lane.compiled.counters.fallbacks for lane in warm.lanes) == 0


def test_a_lane_compiling_in_the_background_takes_no_chunk_and_holds_no_other(model, monkeypatch):
    """Lane 0's priming class is not prepared: its first priming runs stock while the class
    compiles in a background thread holding lane 0's step (slowed here to 4 s). The scheduler
    dispatches nothing to lane 0 until it is done, and lane 1's session goes on meanwhile."""
    import cadence_fx.prepare as prepare
    pool = _pool(model, lanes=2)
    first = pool.lanes[0].compiled
    for key in [k for k in first.classes if all(e is None for e in k[0][0])]:
        first.store.forget(key)
    real = prepare.prepare

    def slow(*args, **kwargs):
        if threading.current_thread().name.startswith("cadence-prime"):
            time.sleep(4.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare, "prepare", slow)
    scripts = [_script(70, 2), _script(71, 3)]

    async def serve():
        sched = Scheduler(pool, period_ms=60_000.0, poll_ms=0.5)
        sids = [sched.open(None, lane=0), sched.open(None, lane=1)]
        outs = [[], []]

        async def conversation(i):
            for _, x in scripts[i]:
                outs[i].append((await sched.submit(sids[i], x))[0].cpu())

        await asyncio.gather(conversation(0), conversation(1))
        await sched.stop()
        return sched, sids, outs

    sched, sids, outs = asyncio.run(serve())
    assert not _mismatches([0, 1], scripts, outs, model, "background")
    a, b = ([r for r in sched.records if r.sid == s] for s in sids)
    assert a[1].dispatched > b[-1].completed, "lane 1 waited for lane 0's background compile"
    assert first.counters.background_compiles == 1 and sched.report()["compiles"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="concurrent replays need CUDA")
def test_concurrent_lane_replays_are_bit_exact_on_cuda(model):
    """Four lanes replaying at once, driven directly (results read on each lane's stream) and by
    the scheduler (results read on the default stream right after ``await``); a failure lists
    every output that differs, with its session, chunk, lane and max |diff|, and the lanes'
    streams, counters and cuBLAS settings."""
    pool = _pool(model, lanes=4)
    scripts = [_script(40 + s, 6, reset_at=3) for s in range(12)]
    sids, outs = _interleave(pool, scripts, order_seed=11)
    bad = _mismatches([pool.lane_of(s) for s in sids], scripts, outs, model, "interleaved")
    assert not bad, "\n".join(bad + [_lanes_report(pool)])
    assert all(lane.compiled.counters.replays > 0 for lane in pool.lanes), _lanes_report(pool)
    report, outs, lanes = asyncio.run(_serve(pool, scripts, seed=12, lanes=True))
    bad = _mismatches(lanes, scripts, [[o.cpu() for o in out] for out in outs], model, "scheduled")
    assert not bad, "\n".join(bad + [_lanes_report(pool), str(report)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")
def test_lane_and_capture_streams_are_never_shared_when_torchs_pool_wraps():
    """torch hands out 32 pooled streams round-robin: a lane's or a capture's stream must not come
    back to another live lane (their graphs would share a cuBLAS workspace)."""
    import gc
    from cadence_fx import capture_streams
    gc.collect()   # steps of earlier tests still waiting for the collector give theirs back
    free = 32 - len(capture_streams._HELD)   # lanes and captures still alive in this process hold the rest
    assert free >= 4, f"{32 - free} pooled streams are held by live lanes or captures"
    held = [capture_streams.private_stream() for _ in range(free - 2)]
    for _ in range(45):   # move torch's round-robin past the held ones, twice over
        torch.cuda.Stream()
    more = [capture_streams.private_stream() for _ in range(2)]
    handles = [s.cuda_stream for s in held + more]
    assert len(set(handles)) == len(handles)


def test_lane_threads_keep_each_sessions_draws_its_own():
    """A step drawing randomness, its chunks queued from the lanes' own threads: each session
    still equals itself run alone from its seed (the pool swaps generator states under one
    process lock, so two lane threads never draw from each other's state)."""
    from cadence_fx.models.toy import NOISY_ADAPTER, NoisySourceToy
    model = NoisySourceToy()
    g = torch.Generator().manual_seed(2)
    xs = [[torch.randn(1, 16, 8, generator=g) for _ in range(5)] for _ in range(4)]
    zero = torch.zeros(1, 16, 2)

    refs = [[y for y, _ in stream(model, xs[s], zero, None, reset_at=len(xs[s]),
                                  before=lambda i, s=s: i or torch.manual_seed(100 + s),
                                  mode=torch.inference_mode)] for s in range(4)]
    pool = cadence_fx.SessionPool(cadence_fx.compile(model, NOISY_ADAPTER), lanes=2)
    queued_on = set()

    def run(sid, x):
        queued_on.add(threading.current_thread().name.split("_")[0])
        return pool.step(sid, x)

    async def serve():
        sched = Scheduler(pool, period_ms=60_000.0, poll_ms=0.1, threads=True, run=run)
        ids = [sched.open(zero, seed=100 + s) for s in range(4)]

        async def conversation(s):
            return [(await sched.submit(ids[s], x))[0].clone() for x in xs[s]]

        outs = await asyncio.gather(*(conversation(s) for s in range(4)))
        await sched.stop()
        return outs

    outs = asyncio.run(serve())
    for s in range(4):
        assert [torch.equal(a, b) for a, b in zip(refs[s], outs[s])] == [True] * 5
    assert queued_on == {"cadence-lane0", "cadence-lane1"}
    steps = [lane.compiled.counters for lane in pool.lanes]
    assert sum(k.compiled_calls for k in steps) == 20 and sum(k.fallbacks for k in steps) == 0


def test_a_session_closed_while_its_chunk_is_queued_on_its_lane_thread(monkeypatch):
    """Lane threads: a client goes away while its chunk is still being queued (queuing slowed to
    50 ms, as when the launch queue is full). The pool closes it after that chunk, on the lane's
    thread, so the lane's other session goes on exactly."""
    from cadence_fx.models.toy import NOISY_ADAPTER, NoisySourceToy
    from cadence_fx.runtime import CompiledStep
    model = NoisySourceToy()
    pool = cadence_fx.SessionPool(cadence_fx.compile(model, NOISY_ADAPTER), lanes=1)
    zero = torch.zeros(1, 16, 2)
    x = torch.randn(1, 16, 8, generator=torch.Generator().manual_seed(1))
    real = CompiledStep.__call__

    def slow(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        time.sleep(0.05)
        return out

    monkeypatch.setattr(CompiledStep, "__call__", slow)

    async def serve():
        sched = Scheduler(pool, period_ms=60_000.0, poll_ms=0.1, threads=True)
        a, b = sched.open(zero, seed=1), sched.open(zero, seed=2)
        await sched.submit(a, x)
        first_b = (await sched.submit(b, x))[0].clone()
        pending = sched.submit(a, x)
        await asyncio.sleep(0.01)   # a's chunk is being queued on the lane's thread
        sched.close(a)
        await pending
        second_b = (await sched.submit(b, x))[0].clone()
        await sched.stop()
        return first_b, second_b

    first_b, second_b = asyncio.run(serve())
    torch.manual_seed(2)
    with torch.inference_mode():
        want1, cache = model(x, zero)
        want2, _ = model(x, cache)
    assert torch.equal(first_b, want1) and torch.equal(second_b, want2)
    assert pool.sessions == [1]


def test_lanes_of_a_drawing_step_own_generator_states_only_on_cuda():
    """Lanes after the first draw from a device generator state of their own on CUDA (their
    graphs register it); lane 0, the CPU and steps that draw nothing keep the default one."""
    from cadence_fx.models.toy import NOISY_ADAPTER, NoisySourceToy
    pool = cadence_fx.SessionPool(cadence_fx.compile(NoisySourceToy().to(DEVICE), NOISY_ADAPTER),
                                  lanes=3)
    gens = [lane.generator for lane in pool.lanes]
    if DEVICE == "cpu":
        assert gens == [None, None, None]
        return
    assert gens[0] is None and all(isinstance(g, torch.Generator) for g in gens[1:])
    assert gens[1] is not gens[2]
    quiet = cadence_fx.SessionPool(cadence_fx.compile(make_decoder().to(DEVICE), ADAPTER), lanes=2)
    assert [lane.generator for lane in quiet.lanes] == [None, None]


class _SlowNoisy(torch.nn.Module):
    """``NoisySourceToy`` after about 10 ms of matrix products, in one graph: the draws come
    long after a replay has filled its generator state's seed and offset holder."""

    def __init__(self):
        super().__init__()
        from cadence_fx.models.toy import NoisySourceToy
        self.noisy = NoisySourceToy()
        self.big = torch.nn.Parameter(torch.randn(2048, 2048, generator=torch.Generator()
                                                  .manual_seed(3)) / 45.0)

    def forward(self, x, cache):
        m = self.big * x.mean()
        for _ in range(30):
            m = torch.tanh(m @ self.big)
        y, cache = self.noisy(x, cache)
        return y + 1e-3 * m.mean(), cache


@pytest.mark.skipif(not torch.cuda.is_available(), reason="concurrent replays need CUDA")
def test_drawing_chunks_of_two_lanes_overlap_on_the_device_and_stay_exact():
    """Two sessions of a step drawing device randomness, one per lane, their chunks queued back
    to back from one thread with nothing between them: lane 1's replay fills its generator
    state's holder while lane 0's graph is still in its matrix products, before its draws. Each
    lane registered a state of its own, so each session still equals itself alone from its seed
    (lanes sharing the default state raced on its holder: lane 0 drew lane 1's numbers)."""
    from cadence_fx.models.toy import NOISY_ADAPTER
    model = _SlowNoisy().cuda()
    g = torch.Generator().manual_seed(5)
    xs = [[torch.randn(1, 16, 8, generator=g).cuda() for _ in range(6)] for _ in range(2)]
    zero = torch.zeros(1, 16, 2, device="cuda")
    refs = []
    for s in range(2):
        torch.manual_seed(70 + s)
        cache, outs = zero, []
        with torch.inference_mode():
            for x in xs[s]:
                y, cache = model(x, cache)
                outs.append(y.cpu())
        refs.append(outs)
    pool = cadence_fx.SessionPool(cadence_fx.compile(model, NOISY_ADAPTER), lanes=2)
    sids = [pool.open(zero, seed=70 + s, lane=s) for s in range(2)]
    got = [[], []]
    with torch.inference_mode():
        for i in range(6):
            ys = [pool.step(sid, xs[s][i])[0] for s, sid in enumerate(sids)]   # back to back
            for s, sid in enumerate(sids):
                got[s].append(_read(pool, sid, ys[s]))
    torch.cuda.synchronize()
    for s in range(2):
        assert [torch.equal(a.cpu(), b) for a, b in zip(got[s], refs[s])] == [True] * 6, \
            _lanes_report(pool)
    assert all(lane.compiled.counters.replays >= 5 for lane in pool.lanes), _lanes_report(pool)
    assert sum(lane.compiled.counters.fallbacks for lane in pool.lanes) == 0
