"""Lanes and the deadline scheduler, on the streaming decoder of tests/streaming_decoder.py.

A pool of L lanes places each session on one lane for life (the least loaded); lanes hold their
own carries and graphs, so a session's outputs, priming passes and turn resets included, are
bit-exact against the session run alone through stock whatever ran on any lane; a lane whose
captures fail runs its pieces eagerly while the other lanes replay; the scheduler serves a
bounded random workload (Poisson arrivals, random conversation lengths) with every session
checked against itself alone. The CUDA tests (skipped on the CPU) replay lanes concurrently."""
import asyncio
import dataclasses
import random

import pytest
import torch

import cadence_fx
from cadence_fx.scheduler import Scheduler
from replay_stand_in import StandInBackend
from streaming_decoder import CALL, CHUNK, DECODER_ADAPTER, PROMPT, chunks, make_decoder, prompt

ADAPTER = dataclasses.replace(DECODER_ADAPTER, prompt_lengths=(PROMPT,))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
            outs[i].append(pool.step(sids[i], x)[0].clone())
            pos[i] += 1
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return sids, [[o.cpu() for o in out] for out in outs]


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


async def _serve(pool, scripts, seed):
    """Poisson arrivals; each conversation submits its calls one after the other."""
    sched = Scheduler(pool, period_ms=5000.0, poll_ms=0.1)
    g = random.Random(seed)
    outs = [[] for _ in scripts]

    async def conversation(i):
        sid = sched.open(None)
        for j, (op, x) in enumerate(scripts[i]):
            if op == "prime" and j > 0:
                pool.reset(sid, None)
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
    return sched.report(), outs


def test_scheduler_serves_a_random_workload_exactly(model):
    pool = _pool(model, lanes=2)
    g = random.Random(7)
    scripts = [_script(20 + s, g.randint(1, 5), reset_at=g.choice([None, 1])) for s in range(8)]
    report, outs = asyncio.run(_serve(pool, scripts, seed=7))
    for script, out in zip(scripts, outs):
        assert _exact([o.cpu() for o in out], _alone(model, script))
    assert report["chunks"] == sum(len(s) for s in scripts)
    assert report["deadline_misses"] == 0 and report["latency_p99_ms"] >= report["latency_p50_ms"]
    assert set(report["chunks_per_lane"]) == {0, 1} and not pool.sessions
    assert sum(lane.compiled.counters.fallbacks for lane in pool.lanes) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="concurrent replays need CUDA")
def test_concurrent_lane_replays_are_bit_exact_on_cuda(model):
    pool = _pool(model, lanes=4)
    scripts = [_script(40 + s, 6, reset_at=3) for s in range(12)]
    _, outs = _interleave(pool, scripts, order_seed=11)
    for script, out in zip(scripts, outs):
        assert _exact(out, _alone(model, script))
    assert all(lane.compiled.counters.replays > 0 for lane in pool.lanes)
    report, outs = asyncio.run(_serve(pool, scripts, seed=12))
    for script, out in zip(scripts, outs):
        assert _exact([o.cpu() for o in out], _alone(model, script))
