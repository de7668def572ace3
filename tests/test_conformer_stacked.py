"""The streaming conformer with its per-layer caches stacked into one tensor per kind (as
Freeze-Omni and WeNet-style encoders keep them; ``StreamingConformer(stacked=True)``), served the
way a server serves it: each speaker primed inline through the session pool (the cache-free
prompt pass is the step's priming class), sessions arriving while others stream, retiring, a
chunk retried from a cloned state and a turn re-primed. Every output and returned state tensor is
compared with ``torch.equal`` against the stock module, each session against itself run alone;
the compiled path is asserted (every call compiled, the rewrite kinds, no concatenation left)."""
from __future__ import annotations

import pytest
import torch

import cadence_fx
from cadence_fx.passes.fx_utils import aten

from streaming_conformer import one_thread  # noqa: F401 - autouse: one intra-op thread per file
from streaming_conformer import (FLUSH, STACKED_ADAPTER, assert_calls_equal,
                                 assert_sessions_equal, chunk_feats, joins_feeding_carries,
                                 make_model, prompt_feats, run_alone, run_turns, serve_scripts)

REGIONS = [r.name for r in STACKED_ADAPTER.regions]
TURNS = [(0, [8, 12, 12, 8, FLUSH]), (1, [12, 8, 8, 12])]


@pytest.fixture(scope="module")
def model():
    return make_model(stacked=True)


@pytest.fixture(scope="module")
def stock():
    return make_model(stacked=True)


@pytest.fixture(scope="module")
def traces():
    return {}


def _compile(model, traces, **kwargs):
    return cadence_fx.compile(model, STACKED_ADAPTER, trace_cache=traces, **kwargs)


JOINS = (aten.cat.default, aten.stack.default)


def test_stacked_caches_stream_bit_exact_in_place(model, stock, traces):
    want, want_rng = run_turns(stock, TURNS, seed=21)
    c = _compile(model, traces, verify=True)
    got, got_rng = run_turns(c, TURNS, seed=21)
    assert_calls_equal(got, want)
    assert all(state.keys() == {"k", "v", "conv", "offset"} for _, state in want)
    assert torch.equal(got_rng, want_rng)
    calls = sum(len(w) + 1 for _, w in TURNS)
    k = c.counters
    assert (k.calls, k.compiled_calls, k.fallbacks, dict(k.reasons)) == (calls, calls, 0, {})
    assert k.carry_addresses == 1 and set(k.addresses) == set(REGIONS)
    assert k.retentions > 0 and k.applications == sum(c.auditor.comparisons.values()) > 0
    # every class that takes region state in writes each stacked region in place
    report = {(tuple(cls["extents"]), cls["width"]): cls for cls in c.report().as_dict()["classes"]}
    streamed = [key for key, cls in report.items() if None not in cls["extents"]]
    assert len(streamed) == 5, sorted(report)   # 8/12 at the prompt's extent, 8/12/flush at W
    for key in streamed:
        kinds = {w["region"]: w["kind"] for w in report[key]["rewrites"] if w["region"] in REGIONS}
        assert set(kinds) == set(REGIONS) and set(kinds.values()) <= {"retention", "append"}, kinds
    for key, entry in c.classes.items():
        if None not in key[0][0]:
            assert joins_feeding_carries(entry, JOINS) == [], key


# Per session: (speaker, generator seed, feature seed, script). "prime" runs the speaker's prompt
# through the pool (the session's state is None before it), an int is a chunk of the session's
# features, "save" clones the state, "retry" goes back to it, "close" retires the session.
SESSIONS = [
    (0, 200, 1, ["prime", 0, 1, "save", 2, 3, "retry", 2, 3, "prime", 4, 5, 6]),
    (1, 201, 2, ["prime", 0, 1, 2, "close"]),
    (2, 202, 3, ["prime", 0, 1, 2, 3, 4]),
    (3, 203, 4, ["prime", 0, 1, "prime", 2, 3, "close"]),
]
WIDTHS = [8, 12, 8, 12, 8, 12, FLUSH]
ARRIVALS = [0, 0, 4, 8]


@pytest.mark.parametrize("order", [5, 6])
def test_pool_primes_each_speaker_inline_while_others_stream(model, stock, traces, order):
    feats = [chunk_feats(WIDTHS, seed) for *_, seed, _ in SESSIONS]
    alone = [run_alone(stock, rng, feats[i], script, prompt=prompt_feats(spk))
             for i, (spk, rng, _, script) in enumerate(SESSIONS)]
    pool = cadence_fx.SessionPool(_compile(model, traces))
    outside = torch.get_rng_state()
    outs, _, seen = serve_scripts(pool, SESSIONS, ARRIVALS, feats, seed=order)
    assert_sessions_equal(outs, alone)
    assert seen["primed"] >= 2 and seen["retired"] == 2   # while others streamed
    assert torch.equal(torch.get_rng_state(), outside)
    k = pool.compiled.counters
    calls = sum(op == "prime" or isinstance(op, int) for *_, script in SESSIONS for op in script)
    assert (k.calls, k.compiled_calls, k.fallbacks, dict(k.reasons)) == (calls, calls, 0, {})
    assert pool.swaps > 0 and k.carry_addresses == 1
    primed = [key for key in pool.compiled.classes if None in key[0][0]]
    assert len(primed) == 1   # the prompt pass: one class, compiled like the others
