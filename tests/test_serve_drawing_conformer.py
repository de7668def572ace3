"""A model that draws device randomness, served the way a replica serves it, without Ray: the
streaming conformer of ``tests/streaming_conformer.py`` (every chunk dithers its features with
``randn_like``) through ``PoolEngine`` on two lanes. Speakers primed per session, sessions with
generator seeds arriving and leaving, chunks sent from threads at once, turn resets ending on a
partial chunk, a session lost with its replica and retried from the start on a restarted
replica (same compile cache: nothing traced). Every session equals itself run alone on the stock
step from the same seed, and the compiled path is what ran. On CUDA (the device's ``-m gpu``) the
lanes' graphs draw from generator states of their own (lane 0 the default one), which is what
this file exercises there; on the CPU lanes own none and the same sessions must still be exact."""

import pytest
import torch

from cadence_fx.serve.engine import PoolEngine
from cadence_fx.serve.models import StockSession, build
from helpers import talk_at_once
from streaming_conformer import CHUNKS, FLUSH, chunk_feats

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OWN = "streaming_conformer:served"
pytestmark = pytest.mark.gpu   # on CUDA where it is there, else the CPU


def _turn(speaker, turn, chunks):
    """``chunks`` steady chunks (both widths), then the flush that ends the turn."""
    widths = [CHUNKS[(speaker + i) % 2] for i in range(chunks)] + [FLUSH]
    return [{"feats": x} for x in chunk_feats(widths, seed=100 * speaker + turn)]


class Talker:
    """A session on the engine (primed with its speaker, drawing from ``seed``) and the same
    speaker and seed alone on the stock step."""

    def __init__(self, engine, model, speaker, seed, lane=None):
        prompt = {"speaker": torch.tensor([speaker])}
        self.engine, self.speaker = engine, speaker
        self.sid = engine.open(prompt=prompt, seed=seed, lane=lane)
        self.ref = StockSession(model, prompt=prompt, seed=seed)
        self.chunks = 0

    def say(self, turn, chunks, stop_after=None):
        for i, x in enumerate(_turn(self.speaker, turn, chunks)):
            if i == stop_after:
                return
            last = i == chunks
            out, record = self.engine.chunk(self.sid, x, last=last)
            want = self.ref.chunk(x, last=last)["out"]
            assert record.fallbacks == 0, (self.speaker, turn, i)
            assert torch.equal(out["out"], want.cpu()), (self.speaker, turn, i)
            self.chunks += 1
        self.engine.reset(self.sid)
        self.ref.reset()


def _own_states(engine):
    """Per lane of the conformer's pool: whether it draws from a generator state of its own."""
    return [lane.generator is not None for lane in engine.pools["step"].lanes]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("drawing-conformer-cache")


def _replayed_on_every_lane(engine):
    """On CUDA every lane's chunks replayed captured graphs (on the CPU there are none)."""
    lanes = engine.pools["step"].lanes
    return DEVICE != "cuda" or all(lane.compiled.counters.replays > 0 for lane in lanes)


def test_drawing_sessions_on_two_lanes_from_threads_equal_stock_alone(tmp_path):
    model = build(OWN, device=DEVICE, cache_dir=tmp_path)
    engine = PoolEngine(model, lanes=2)
    warm = engine.warm()
    assert warm["traces"] > 0 and warm["fallbacks"] == 0, warm
    assert _own_states(engine) == ([False, True] if DEVICE == "cuda" else [False, False])
    a, b = Talker(engine, model, 1, seed=11), Talker(engine, model, 2, seed=12)
    assert {engine.lane_of(a.sid), engine.lane_of(b.sid)} == {0, 1}
    a.say(0, 5)
    b.say(0, 2)
    lane = engine.lane_of(a.sid)
    engine.close(a.sid)                       # a leaves; c arrives on a's lane, same speaker
    c = Talker(engine, model, 1, seed=13)
    assert engine.lane_of(c.sid) == lane and engine.live == 2

    talk_at_once([(b, [(1, 7), (2, 3)]), (c, [(0, 9), (1, 2)])])
    k = engine.counters()
    assert k["compiled_calls"] >= a.chunks + b.chunks + c.chunks and k["fallbacks"] == 0, k
    assert _replayed_on_every_lane(engine)
    for t in (b, c):
        engine.close(t.sid)
    assert engine.live == 0


def test_a_session_lost_with_its_replica_is_retried_from_its_start_on_a_restarted_one(cache):
    """The replica dies mid-turn; the client opens the same speaker and seed on the restarted
    replica (same cache: nothing traced) and sends the turn again: every chunk equals stock
    alone, on the lane that draws from a state of its own as well as on lane 0. The lost session
    met a class on lane 1 only (its first chunk is 12 frames wide, the warm-up's 8): the
    restarted replica loads it from the cache, which lane 1 wrote."""
    model = build(OWN, device=DEVICE, cache_dir=cache)
    first = PoolEngine(model, lanes=2)
    first.warm()                              # the cache holds every class the warm-up visits
    lost = Talker(first, model, 3, seed=21, lane=1)
    lost.say(0, 6, stop_after=4)              # the replica is lost here: no reply, no state
    lanes = first.pools["step"].lanes
    assert set(lanes[1].compiled.classes) - set(lanes[0].compiled.classes)
    del first, lost, lanes

    model = build(OWN, device=DEVICE, cache_dir=cache)   # what a restarted replica builds
    engine = PoolEngine(model, lanes=2)
    warm = engine.warm()
    assert warm["traces"] == 0 and warm["fallbacks"] == 0 and warm["compiled_calls"] > 0, warm
    for lane in (1, 0):
        again = Talker(engine, model, 3, seed=21, lane=lane)
        again.say(0, 6)
        again.say(1, 3)
        assert again.chunks == 7 + 4
        engine.close(again.sid)
    k = engine.counters()
    assert k["traces"] == 0 and k["fallbacks"] == 0 and k["compiled_calls"] >= 22, k
    assert all(lane.compiled.counters.compiled_loads > 0 for lane in engine.pools["step"].lanes)
    assert _replayed_on_every_lane(engine)
