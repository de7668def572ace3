"""A streaming conformer of our own (``tests/streaming_conformer.py``) served the way a server
serves it: whole streams with variable chunk widths, flushes and turn resets re-primed from a
speaker's prompt; a session pool with arrivals, retirements and a retried chunk. Every output and
every returned state tensor is compared with ``torch.equal`` against stock eager, with the global
generator seeded identically on both sides (the step dithers its input with device randomness).

The priming pass (the speaker's prompt, no state) is a class of its own, compiled like the others.

Every compiled step here shares one trace cache over one module, so each class is traced once for
the whole file; stock runs on a second module built with the same seed. Intra-op parallelism is
pinned to one thread while the file runs (both sides run under it): on a shared 2-core machine two
OpenMP threads per op make each chunk some 50x slower.
"""
from __future__ import annotations

import pytest
import torch

import cadence_fx
from cadence_fx.passes.fx_utils import aten

from op_count import OpCount, difference
from streaming_conformer import one_thread  # noqa: F401 - autouse: one intra-op thread per file
from streaming_conformer import (CONFORMER_ADAPTER, FLUSH, LAYERS, assert_calls_equal,
                                 assert_sessions_equal, chunk_feats, clone_state,
                                 joins_feeding_carries, make_model, prime, run_alone, run_turns,
                                 serve_scripts)

PRIMING_CLASS = ((None,) * (3 * LAYERS), 16)   # no region state in, the 16-frame prompt
REGIONS = [r.name for r in CONFORMER_ADAPTER.regions]
AT_PROMPT, AT_WINDOW = (16, 16, 4) * LAYERS, (24, 24, 4) * LAYERS   # joint extents, per region

# Three turns (speaker, widths): 8- and 12-frame chunks alternating, two turns ending on a flush.
TURNS = [(0, [8, 12, 12, 8, 8, 12, FLUSH]), (1, [12, 8, 8, 12, 12]), (0, [8, 8, 12, 8, FLUSH])]
STREAM_CLASSES = {(AT_PROMPT, 8), (AT_PROMPT, 12), (AT_WINDOW, 8), (AT_WINDOW, 12),
                  (AT_WINDOW, FLUSH)}
ALL_CLASSES = STREAM_CLASSES | {PRIMING_CLASS}


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def stock():
    return make_model()


@pytest.fixture(scope="module")
def traces():
    return {}


def _compile(model, traces, **kwargs):
    return cadence_fx.compile(model, CONFORMER_ADAPTER, trace_cache=traces, **kwargs)


def _class_keys(compiled):
    return {key[0] for key in compiled.classes}


# -- 1. whole streams --------------------------------------------------------------------------

def test_whole_streams_bit_exact_with_flushes_and_re_primed_turns(model, stock, traces):
    want, want_rng = run_turns(stock, TURNS, seed=7)
    c = _compile(model, traces, verify=True)
    got, got_rng = run_turns(c, TURNS, seed=7)
    assert_calls_equal(got, want)
    assert torch.equal(got_rng, want_rng)   # the compiled path drew exactly what stock drew
    chunks = sum(len(widths) for _, widths in TURNS)
    k = c.counters
    assert (k.calls, k.compiled_calls) == (chunks + len(TURNS), chunks + len(TURNS))
    assert (k.fallbacks, dict(k.reasons)) == (0, {})
    assert k.carry_addresses == 1 and set(k.addresses) == set(REGIONS)
    # the priming pass writes the conv carries; its K/V are transposed projections, handed back
    # in that layout as stock does, and copied into their contiguous carries once per turn
    assert k.absorptions == len(TURNS) * 2 * LAYERS
    assert _class_keys(c) == ALL_CLASSES
    assert k.applications == sum(c.auditor.comparisons.values()) > 0   # every carry write audited


def test_width_outside_the_catalog_falls_back_bit_exact(model, stock, traces):
    """A 10-frame chunk is neither a declared width nor a flush: the stock step runs it, and the
    stream comes back to the catalog on the next call (24 + 10 is cut back to the window)."""
    turns = [(2, [8, 10, 12, 8])]
    want, _ = run_turns(stock, turns, seed=8)
    c = _compile(model, traces)
    got, _ = run_turns(c, turns, seed=8)
    assert_calls_equal(got, want)
    width = ("call width 10 is neither a declared call width [8, 12] nor admitted "
             "(admission chunk = 8); declare a clock of 10 in `call_frames`, or an `admission` "
             "clock of at least 10 for partial calls")
    assert dict(c.counters.reasons) == {width: 1}
    assert c.counters.compiled_calls == 4 and c.counters.carry_addresses == 1


# -- 2. a session pool -------------------------------------------------------------------------

# Per session: (speaker, generator seed, feature seed, script). Script ops: an int is a chunk of
# the session's features by index; "save" clones the state, "retry" goes back to the saved state
# (the chunks after it are sent again), "reset" is a turn boundary, "close" retires the session.
SESSIONS = [
    (0, 100, 1, [0, 1, "save", 2, 3, "retry", 2, 3, 4, "reset", 5, 6, 7]),
    (1, 101, 2, [0, 1, 2, 3, "close"]),
    (2, 102, 3, [0, 1, 2, 3]),
    (0, 103, 4, [0, 1, "reset", 2, 3, 4, "close"]),
]
WIDTHS = [8, 12, 8, 12, 8, 12, 8, FLUSH]
ARRIVALS = [0, 0, 5, 9]   # global step at which each session may start


def test_session_pool_serves_arrivals_retirements_and_retries(model, stock, traces):
    # the server primes each speaker once, on the stock module, and keeps the prompt state
    torch.manual_seed(50)
    prompts = {s: prime(stock, s) for s in {spk for spk, *_ in SESSIONS}}
    pristine = {s: clone_state(p) for s, p in prompts.items()}
    feats = [chunk_feats(WIDTHS, seed) for _, _, seed, _ in SESSIONS]
    alone = [run_alone(stock, rng, feats[i], script, start=prompts[spk])
             for i, (spk, rng, _, script) in enumerate(SESSIONS)]

    pool = cadence_fx.SessionPool(_compile(model, traces))
    outside = torch.get_rng_state()
    outs, ids, seen = serve_scripts(pool, SESSIONS, ARRIVALS, feats, seed=3,
                                    start=lambda spk: prompts[spk])
    assert_sessions_equal(outs, alone, "chunk")
    assert seen["arrived"] >= 2 and seen["retired"] == 2   # while others streamed
    assert pool.sessions == sorted(ids[i] for i in (0, 2))
    assert torch.equal(torch.get_rng_state(), outside)        # sessions draw from their own
    assert all(torch.equal(prompts[s][k], pristine[s][k]) for s in prompts for k in pristine[s])
    k = pool.compiled.counters
    chunks = sum(isinstance(op, int) for *_, script in SESSIONS for op in script)
    assert (k.calls, k.compiled_calls, k.fallbacks, dict(k.reasons)) == (chunks, chunks, 0, {})
    assert pool.swaps > 0 and k.carry_addresses == 1
    assert _class_keys(pool.compiled) <= STREAM_CLASSES


# -- 3. what the product must do and does not do yet -------------------------------------------

def test_kv_and_conv_regions_are_rewritten_in_place(model, traces):
    c = _compile(model, traces)
    run_turns(c, TURNS, seed=9)
    k = c.counters
    assert k.compiled_calls >= sum(len(widths) for _, widths in TURNS) and k.carry_addresses == 1
    assert not k.reasons
    # the classes that take region state in (a compiled priming pass, if any, has none)
    classes = {(tuple(cls["extents"]), cls["width"]): cls
               for cls in c.report().as_dict()["classes"]}
    entries = {key[0]: entry for key, entry in c.classes.items() if key[0] in STREAM_CLASSES}
    assert set(entries) == STREAM_CLASSES and STREAM_CLASSES <= set(classes)
    for key in sorted(STREAM_CLASSES):
        kinds = {w["region"]: w["kind"] for w in classes[key]["rewrites"] if w["region"] in REGIONS}
        assert set(kinds) == set(REGIONS), key
        assert all(kind in ("retention", "append") for kind in kinds.values()), (key, kinds)
        assert joins_feeding_carries(entries[key], (aten.cat.default,)) == [], key
    assert k.retentions > 0


@pytest.mark.parametrize("width", [8, 12])
def test_compiled_chunk_launches_no_more_kernels_than_stock(model, stock, traces, width):
    """Per steady chunk at the window, the aten ops that launch a kernel (views excluded): each
    region's cat is gone; the new frames are written into the carry's room and the kept frames
    move down (through one temporary where the move would take more than two pieces)."""
    c = _compile(model, traces)
    torch.manual_seed(11)
    with torch.no_grad():
        state = prime(stock, 3)
        x0, x1 = chunk_feats([8, width], seed=11)
        c(x1, c(x0, state)[1])                  # both classes compiled: no tracing counted below
        _, got_state = c(x0, state)             # a turn reset, then one steady chunk at the window
        _, ref_state = stock(x0, state)
        with OpCount() as ours:
            c(x1, got_state)
        with OpCount() as theirs:
            stock(x1, ref_state)
    assert c.counters.compiled_calls == 4 and c.counters.fallbacks == 0
    assert c.counters.carry_addresses == 1
    assert ours.total <= theirs.total, difference(ours, theirs)
    assert theirs.ops[aten.cat.default] - ours.ops[aten.cat.default] >= len(REGIONS)   # each region's


def test_priming_pass_runs_compiled(model, stock, traces):
    want, want_rng = run_turns(stock, TURNS[:2], seed=12)
    c = _compile(model, traces)
    got, got_rng = run_turns(c, TURNS[:2], seed=12)
    assert_calls_equal(got, want)
    assert torch.equal(got_rng, want_rng)
    k = c.counters
    calls = sum(len(widths) + 1 for _, widths in TURNS[:2])
    assert (k.calls, k.compiled_calls, k.fallbacks, dict(k.reasons)) == (calls, calls, 0, {})
    assert k.carry_addresses == 1


def test_strict_accepts_a_whole_primed_stream(model, stock, traces):
    want, _ = run_turns(stock, TURNS, seed=13)
    c = _compile(model, traces, strict=True)
    got, _ = run_turns(c, TURNS, seed=13)
    assert_calls_equal(got, want)
    k = c.counters
    assert (k.fallbacks, k.compiled_calls, k.carry_addresses) == (0, k.calls, 1)


def test_catalog_captured_before_traffic(model, stock, traces):
    c = _compile(model, traces)
    torch.manual_seed(14)
    state = prime(stock, 0)
    pristine, rng = clone_state(state), torch.get_rng_state()
    with torch.no_grad():
        done = c.capture_catalog(chunk_feats([8], seed=14)[0], state)
    assert done == {cls: True for cls in c.catalog.classes}
    assert _class_keys(c) == set(c.catalog.classes)
    assert torch.equal(torch.get_rng_state(), rng) and c.counters.calls == 0
    assert all(torch.equal(state[k], pristine[k]) for k in state)
    want, _ = run_turns(stock, TURNS[:1], seed=14)
    got, _ = run_turns(c, TURNS[:1], seed=14)
    assert_calls_equal(got, want)
    # the flush is admitted but is no declared width: its class is compiled on first sight
    assert _class_keys(c) == set(c.catalog.classes) | {(AT_WINDOW, FLUSH), PRIMING_CLASS}
    k = c.counters
    assert k.compiled_calls == len(TURNS[0][1]) + 1 and not k.reasons
    assert k.carry_addresses == 1


# -- 7. through torch.compile ------------------------------------------------------------------

@pytest.mark.parametrize("dynamic", [None, False])
def test_torch_compile_backend_streams_the_whole_model_on_the_cadence_path(stock, dynamic):
    """``torch.compile(backend="cadence")`` over the same turns: dynamo hands one graph per shape
    (with ``dynamic=None`` symbolic ones after the first recompile; each is traced again at the
    exact shapes the stream reaches), the priming graphs run as dynamo traced them, and every
    chunk runs a compiled class: bit-exact, the generator drawn as stock drew it."""
    from torch._dynamo import register_backend

    import cadence_fx.backend
    steps = []

    def spy(gm, example_inputs, **kwargs):
        run = cadence_fx.backend.cadence_backend(gm, example_inputs, **kwargs)
        steps.append(getattr(run, "cadence", None))   # None: a priming graph, run as traced
        return run

    register_backend(name=f"cadence_spy_{dynamic}")(spy)
    torch._dynamo.reset()
    model = make_model()
    compiled = torch.compile(model, backend=f"cadence_spy_{dynamic}", dynamic=dynamic,
                             options={"adapter": CONFORMER_ADAPTER})
    want, want_rng = run_turns(stock, TURNS, seed=7)
    got, got_rng = run_turns(compiled, TURNS, seed=7)
    torch._dynamo.reset()
    assert_calls_equal(got, want)
    assert torch.equal(got_rng, want_rng)
    cadence = [s for s in steps if s is not None]
    chunks = sum(len(widths) for _, widths in TURNS)
    assert sum(s.counters.compiled_calls for s in cadence) == chunks
    assert sum(s.counters.calls for s in cadence) == chunks
    assert all(s.counters.fallbacks == 0 for s in cadence)
    assert all(len(s.adapter.regions) == len(REGIONS) for s in cadence)   # every region bound
    assert None in steps   # the priming pass: its own graph, no region state
    shown = cadence_fx.backend.report()   # what torch.compile hides: every step it compiled
    at = [next(i for i, s in enumerate(shown.steps) if s is c) for c in cadence]
    text, html = str(shown), shown._repr_html_()
    for i in at:
        assert f"== dynamo graph {i} (streaming-conformer)" in text
        assert f"dynamo graph {i} (streaming-conformer)" in html
    assert all(f"  {r:<24} extents" in text for r in REGIONS)   # every region, from the catalog
