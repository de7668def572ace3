"""Serving one's own model: ``cadence_fx.serve.models.build("package.module:factory")`` on the
self-written speaker-prompted decoder (``tests/streaming_prompt_decoder.py``, ``served``), run the
way a replica runs it, without Ray: speakers each primed with their own prompt, sessions arriving
and leaving on two lanes, chunks sent from threads at once, turn resets ending on a partial
chunk, a restart on the same compile cache. Every session equals itself run alone on the stock
step; the compiled path is what ran. Bad model names say what to give."""
import argparse

import pytest
import torch

from cadence_fx.serve.engine import PoolEngine
from cadence_fx.serve.models import ServedModel, StockSession, build
from helpers import talk_at_once
from streaming_prompt_decoder import CHUNK, FLUSH, PROMPT, VOCAB

OWN = "streaming_prompt_decoder:served"


def _prompt(speaker):
    g = torch.Generator().manual_seed(500 + speaker)
    return {"tokens": torch.randint(0, VOCAB, (1, PROMPT), generator=g)}


def _turn(speaker, turn, chunks):
    """``chunks`` full chunks, then the partial one that ends the turn."""
    g = torch.Generator().manual_seed(100 * speaker + turn)
    return [{"tokens": torch.randint(0, VOCAB, (1, w), generator=g)}
            for w in [CHUNK] * chunks + [FLUSH]]


class Speaker:
    """A session on the engine and the same speaker alone on the stock step."""

    def __init__(self, engine, model, speaker):
        self.engine, self.speaker = engine, speaker
        self.sid = engine.open(prompt=_prompt(speaker))
        self.ref = StockSession(model, prompt=_prompt(speaker))
        self.chunks = 0

    def say(self, turn, chunks):
        xs = _turn(self.speaker, turn, chunks)
        for i, x in enumerate(xs):
            last = i == len(xs) - 1
            out, record = self.engine.chunk(self.sid, x, last=last)
            assert record.fallbacks == 0, (self.speaker, turn, i)
            assert torch.equal(out["mel"], self.ref.chunk(x, last=last)["mel"]), \
                (self.speaker, turn, i)
            self.chunks += 1
        self.engine.reset(self.sid)   # the next turn starts from the speaker's primed state
        self.ref.reset()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("own-model-cache")


def test_own_model_sessions_arrive_and_leave_on_two_lanes_exact_against_stock(cache):
    model = build(OWN, cache_dir=cache)
    assert isinstance(model, ServedModel) and model.name == "prompt-decoder"
    engine = PoolEngine(model, lanes=2)
    warm = engine.warm()
    assert warm["traces"] > 0 and warm["fallbacks"] == 0
    a, b = Speaker(engine, model, 1), Speaker(engine, model, 2)
    assert {engine.lane_of(a.sid), engine.lane_of(b.sid)} == {0, 1}
    a.say(0, 9)                  # past prompt + history: the caches are cut from here on
    b.say(0, 3)
    lane = engine.lane_of(a.sid)
    engine.close(a.sid)          # a leaves; c arrives with a speaker of its own, on a's lane
    c = Speaker(engine, model, 3)
    assert engine.lane_of(c.sid) == lane and engine.live == 2

    talk_at_once([(b, [(1, 8), (2, 2)]), (c, [(0, 10), (1, 1)])])
    counters = engine.counters()
    assert counters["compiled_calls"] >= a.chunks + b.chunks + c.chunks
    assert counters["fallbacks"] == 0
    for s in (b, c):
        engine.close(s.sid)
    assert engine.live == 0


def test_a_restarted_replica_of_the_own_model_traces_nothing_and_stays_exact(cache):
    first = PoolEngine(build(OWN, cache_dir=cache))
    first.warm()   # the cache holds every class the warm-up stream visits
    model = build(OWN, cache_dir=cache)   # what a restarted replica builds
    engine = PoolEngine(model)
    warm = engine.warm()
    assert warm["traces"] == 0 and warm["fallbacks"] == 0 and warm["compiled_calls"] > 0, warm
    s = Speaker(engine, model, 4)
    s.say(0, 9)
    assert engine.counters()["traces"] == 0


def test_own_model_names_say_what_to_give(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="package.module:factory"):
        build("prompt-decoder")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'.*PYTHONPATH"):
        build("no_such_module:served")
    with pytest.raises(ValueError, match="has no function 'nothing'"):
        build("streaming_prompt_decoder:nothing")
    (tmp_path / "not_served.py").write_text("def factory(device, cache_dir, full):\n"
                                            "    return object()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError, match="returned object; return a cadence_fx.serve"):
        build("not_served:factory")


def test_cadence_fx_serve_checks_an_own_model_before_starting_ray(capsys):
    pytest.importorskip("ray.serve")
    from cadence_fx.cli import _served_model
    from cadence_fx.serve.launch import serve_locally
    assert _served_model(OWN) == OWN and _served_model("toy") == "toy"
    for bad in ("prompt-decoder", "module:", ":factory"):
        with pytest.raises(argparse.ArgumentTypeError, match="package.module:factory"):
            _served_model(bad)
    args = argparse.Namespace(model="no_such_module:served")   # nothing else is read first
    assert serve_locally(args) == 2
    assert "cannot import 'no_such_module'" in capsys.readouterr().err
