"""The replay guard on the CPU, through a stand-in device-graph backend (``replay_stand_in``):
a piece replays only while the staged inputs have the captured signature (strides included) and
the fixed-address inputs sit where they were captured; an address that moved invalidates the
class (logged), which runs eagerly once and is captured again, or stays eager with the reason when
the adapter turns re-capture off; a failed capture leaves the piece eager with its reason.

The stand-in replays what it bound at capture, as a device graph does, so a replay the guard
should have refused shows up in the results, not only in the counters. One piece on its own is
asserted exactly (counters, reasons, log lines): the eager backend, an eager piece, value
arguments in the signature, a failed capture logged once, an invalidation naming only what
moved, no staging on the eager path, the probationary call putting back an argument it writes.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import cadence_fx
from cadence_fx.counters import Counters
from cadence_fx.errors import GuardError
from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
from cadence_fx.passes.pipeline import Options
from cadence_fx.replay import EagerBackend, GuardedPiece
from replay_stand_in import StandInBackend
from helpers import same, stream

WIDTHS = [8] * 7 + [10] + [8] * 5 + [10]   # two turns, each ending in a 10-frame call
RESET_AT = 8
MOVED = "piece_0: fixed-address input(s) ['param inp.weight'] moved (invalidated)"


def _prompt(seed=11):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        _, state = PromptRetainedToy()(torch.randn(1, 24, 64, generator=g), None)
    xs = [torch.randn(1, w, 64, generator=g) for w in WIDTHS]
    return {k: v.clone() for k, v in state.items()}, xs


def _stream(step, prompt, xs, before=None):
    """Outputs and states, cloned, of a stream with a turn reset; ``before(i)`` runs first."""
    return stream(step, xs, prompt, "att", reset_at=RESET_AT, before=before)


def _same(a, b):
    """Per chunk, whether output and state are equal."""
    return [same(x, y) for x, y in zip(a, b)]


def _reload_weight_at(call, *modules):
    """At ``call``, every module gets new values in a newly allocated ``inp.weight`` (a caller
    loading other weights): same for stock and compiled, at a new address."""
    new = torch.randn(64, 64, generator=torch.Generator().manual_seed(99)) * 0.2

    def before(i):
        if i == call:
            for m in modules:
                m.inp.weight.data = new.clone()
    return before


# -- one piece ---------------------------------------------------------------------------------

def _scale(a, w):
    return (a * w,)


def test_a_staged_input_with_other_strides_runs_eagerly():
    """Same shape, other strides: the signature differs, so the piece runs its eager module
    (whose result keeps the caller's layout, as stock does) and says why."""
    k, backend = Counters(), StandInBackend()
    piece = GuardedPiece(torch.fx.symbolic_trace(_scale), "piece_0", "graph", [], [None, "param w"],
                         [False, False], [True], backend, k)
    w = torch.randn(3, 4)
    a = torch.randn(3, 4)
    assert torch.equal(piece(a, w)[0], a * w)
    assert (k.replays, backend.captured) == (1, 1)
    assert backend.captures[0].staged == (((3, 4), (4, 1), torch.float32),)
    t = torch.randn(4, 3).t()   # (3, 4) with strides (1, 3)
    got, want = piece(t, w)[0], t * w
    assert torch.equal(got, want) and got.stride() == want.stride() == (1, 3)
    assert (k.replays, k.fallbacks, backend.captured) == (1, 1, 1)
    assert k.reasons == {"piece_0: signature differs from the captured one": 1}
    assert torch.equal(piece(a.clone(), w)[0], a * w)   # the captured layout replays again
    assert k.replays == 2


def test_strict_refuses_a_moved_fixed_input():
    k = Counters()
    piece = GuardedPiece(torch.fx.symbolic_trace(_scale), "piece_0", "graph", [],
                         [None, "carry hist"], [False, False], [True], StandInBackend(), k,
                         strict=True)
    a, w = torch.randn(3), torch.randn(3)
    piece(a, w)
    with pytest.raises(GuardError, match=r"strict mode: piece_0: fixed-address input\(s\) "
                                         r"\['carry hist'\] moved \(invalidated\)"):
        piece(a, w.clone())
    assert (k.replays, k.invalidations) == (1, 1)


# -- whole streams -----------------------------------------------------------------------------

def test_a_stream_replays_every_call_and_binds_the_carry():
    prompt, xs = _prompt()
    stock = _stream(PromptRetainedToy(), prompt, xs)
    backend = StandInBackend()
    c = cadence_fx.compile(PromptRetainedToy(), PROMPT_RETAINED_ADAPTER, backend=backend)
    assert _same(stock, _stream(c, prompt, xs)) == [True] * len(xs)
    k = c.counters
    assert (k.compiled_calls, k.replays, k.guarded_eager, k.fallbacks, dict(k.reasons)) == \
        (len(xs), len(xs), 0, 0, {})
    assert k.traces == backend.captured == 4     # (24, 8) (32, 8) (40, 8) (40, 10)
    assert k.invalidations == 0 and k.carry_addresses == 1   # the turn reset moved nothing
    carry = c.carries["att"].tensor.data_ptr()
    for cap in backend.captures:   # the carry is read in place; only the chunk is staged
        assert ("carry att", carry) in cap.fixed
    assert sorted(shape for cap in backend.captures for shape, _, _ in cap.staged) == \
        [(1, 8, 64)] * 3 + [(1, 10, 64)]


def test_a_moved_weight_invalidates_its_classes_which_are_captured_again(caplog):
    """New weights at a new address at call 5: the class replaying then is invalidated (logged),
    runs eagerly, and is captured again at its next call; the classes of the first turn are
    invalidated at their first call after the reset. A replay of the old binding would read the
    old weights, so every output shows whether the guard held."""
    prompt, xs = _prompt()
    stock_model, model = PromptRetainedToy(), PromptRetainedToy()
    stock = _stream(stock_model, prompt, xs, before=_reload_weight_at(5, stock_model))
    backend = StandInBackend()
    c = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER, backend=backend)
    with caplog.at_level(logging.WARNING, logger="cadence_fx.replay"):
        ours = _stream(c, prompt, xs, before=_reload_weight_at(5, model))
    assert _same(stock, ours) == [True] * len(xs)
    k = c.counters
    # invalidated: (40, 8) at call 5, (24, 8) at call 8 and (32, 8) at call 9 (after the reset);
    # captured again: (40, 8) at call 6; (40, 10) is first captured at call 7, after the move
    assert (k.invalidations, dict(k.reasons), k.replays) == (3, {MOVED: 3}, len(xs) - 3)
    assert k.compiled_calls == len(xs) and backend.captured == 5
    moved = [r.getMessage() for r in caplog.records if "invalidated" in r.getMessage()]
    assert moved == ["piece_0 invalidated: fixed-address input(s) ['param inp.weight'] moved"] * 3
    at = [dict(cap.fixed)["param inp.weight"] for cap in backend.captures]
    assert at[:3] == [at[0]] * 3 and at[3:] == [at[3]] * 2 and at[3] != at[0]


def test_without_recapture_a_moved_class_stays_eager_with_the_reason():
    prompt, xs = _prompt()
    stock_model, model = PromptRetainedToy(), PromptRetainedToy()
    stock = _stream(stock_model, prompt, xs, before=_reload_weight_at(5, stock_model))
    adapter = dataclasses.replace(PROMPT_RETAINED_ADAPTER, recapture_on_drift=False)
    backend = StandInBackend()
    c = cadence_fx.compile(model, adapter, backend=backend)
    ours = _stream(c, prompt, xs, before=_reload_weight_at(5, model))
    assert _same(stock, ours) == [True] * len(xs)
    k = c.counters
    off = "piece_0: fixed-address input(s) ['param inp.weight'] moved; re-capture is off"
    # after the move (40, 8) runs calls 5, 6 and 10-12, (24, 8) call 8, (32, 8) call 9: the first
    # call of each class is its invalidation, the later ones stay eager; (40, 10) is captured at
    # call 7, after the move, and replays
    assert dict(k.reasons) == {MOVED: 3, off: 4}
    assert (k.invalidations, k.replays, backend.captured) == (3, len(xs) - 7, 4)


def test_a_failed_capture_leaves_the_piece_eager_with_its_reason():
    prompt, xs = _prompt()
    stock = _stream(PromptRetainedToy(), prompt, xs)
    backend = StandInBackend(fail=torch.OutOfMemoryError("out of memory (injected)"))
    c = cadence_fx.compile(PromptRetainedToy(), PROMPT_RETAINED_ADAPTER, backend=backend)
    assert _same(stock, _stream(c, prompt, xs)) == [True] * len(xs)
    k = c.counters
    failed = "piece_0: capture failed: OutOfMemoryError: out of memory (injected)"
    assert (k.compiled_calls, k.replays, dict(k.reasons)) == (len(xs), 0, {failed: len(xs)})
    assert len(backend.failures) == 4 and backend.captured == 0   # one attempt per class


def test_stock_state_bound_by_address_is_invalidated_where_the_carry_is_not():
    """The Rc ablation (stock-sized state bound by address): the stock code hands back a new
    tensor for its state, so a replay bound to the old one is invalidated; the carry never is."""
    prompt, xs = _prompt()
    stock = _stream(PromptRetainedToy(), prompt, xs)
    rc_backend = StandInBackend()
    rc = cadence_fx.compile(PromptRetainedToy(), PROMPT_RETAINED_ADAPTER, backend=rc_backend,
                            options=Options(state_rule=False, alias_state=True))
    assert _same(stock, _stream(rc, prompt, xs)) == [True] * len(xs)
    k = rc.counters
    assert k.compiled_calls == len(xs) and k.invalidations > 0
    assert k.replays + k.invalidations == len(xs)
    assert set(k.reasons) == {
        "piece_0: fixed-address input(s) ['stock state att'] moved (invalidated)"}
    assert rc_backend.captured > 4   # classes captured again at the state's new address


# -- one piece, asserted exactly ---------------------------------------------------------------

def _piece(backend, kind="graph", **kw):
    return GuardedPiece(torch.fx.symbolic_trace(_scale), "piece_0", kind, ["why"],
                        [None, "param w"], [False, False], [True], backend, Counters(), **kw)


def test_the_eager_backend_runs_every_capturable_piece_behind_its_guard():
    piece = _piece(EagerBackend())
    a, w = torch.randn(3), torch.randn(3)
    for _ in range(3):
        assert torch.equal(piece(a, w)[0], a * w)
    k = piece.counters
    assert (k.guarded_eager, k.replays, k.eager_pieces, k.fallbacks) == (3, 0, 0, 0)
    assert piece.replay is None and piece.eager_reason is None
    assert piece.signature == (((3,), (1,), torch.float32, torch.device("cpu")),)
    assert piece.addresses == (w.data_ptr(),)
    assert EagerBackend.name == "eager" and EagerBackend().lower(piece, (a, w)) == (None, None)


def test_an_eager_piece_counts_itself_and_never_lowers():
    backend = StandInBackend()
    piece = _piece(backend, kind="eager")
    a, w = torch.randn(3), torch.randn(3)
    assert torch.equal(piece(a, w)[0], a * w)
    assert (piece.counters.eager_pieces, piece.counters.guarded_eager, backend.captured) == (1, 0, 0)
    assert piece.signature is None


def test_a_value_argument_is_part_of_the_signature():
    def add(a, n):
        return (a + n,)

    k, backend = Counters(), StandInBackend()
    piece = GuardedPiece(torch.fx.symbolic_trace(add), "piece_0", "graph", [], [None, None],
                         [False, False], [True], backend, k)
    a = torch.randn(2)
    piece(a, 1)
    assert piece.signature == (((2,), (1,), torch.float32, torch.device("cpu")), ("value", 1))
    assert torch.equal(piece(a, 2)[0], a + 2)   # another value: not the captured replay
    assert (k.replays, k.fallbacks) == (1, 1)
    assert dict(k.reasons) == {"piece_0: signature differs from the captured one": 1}


def test_a_call_with_another_number_of_inputs_runs_eagerly():
    k, backend = Counters(), StandInBackend()
    piece = GuardedPiece(torch.fx.symbolic_trace(lambda *a: (a[0] * 2,)), "piece_0", "graph", [],
                         [None], [False], [True], backend, k)
    a = torch.randn(2)
    piece(a)
    assert piece.guard((a, a)) == "signature differs from the captured one"
    assert piece.guard((a,)) is None and k.invalidations == 0


def test_a_failed_capture_is_logged_once_and_falls_back_with_its_reason(caplog):
    backend = StandInBackend(fail=RuntimeError("no room"))
    piece = _piece(backend)
    a, w = torch.randn(3), torch.randn(3)
    with caplog.at_level(logging.WARNING, logger="cadence_fx.replay"):
        piece(a, w)
        piece(a, w)
    assert [r.getMessage() for r in caplog.records] == [
        "piece_0 stays eager: capture failed: RuntimeError: no room"]
    assert dict(piece.counters.reasons) == {"piece_0: capture failed: RuntimeError: no room": 2}
    assert piece.counters.guarded_eager == 0 and len(backend.failures) == 1


def test_an_invalidation_names_only_the_inputs_that_moved():
    def mul3(a, w, v):
        return (a * w * v,)

    k, backend = Counters(), StandInBackend()
    piece = GuardedPiece(torch.fx.symbolic_trace(mul3), "piece_0", "graph", [],
                         [None, "param w", "carry c"], [False, False, False], [True], backend, k)
    a, w, v = torch.randn(3), torch.randn(3), torch.randn(3)
    piece(a, w, v)
    v2 = v.clone()
    assert torch.equal(piece(a, w, v2)[0], a * w * v2)
    assert dict(k.reasons) == {"piece_0: fixed-address input(s) ['carry c'] moved (invalidated)": 1}
    assert piece.signature is None and piece.replay is None   # captured again at the next call
    assert torch.equal(piece(a, w, v2)[0], a * w * v2)
    assert (k.replays, k.invalidations, backend.captured) == (2, 1, 2)


def test_the_report_counts_no_staging_on_the_eager_path():
    g = torch.Generator().manual_seed(0)
    c = cadence_fx.compile(PromptRetainedToy(), PROMPT_RETAINED_ADAPTER)
    with torch.no_grad():
        _, state = PromptRetainedToy()(torch.randn(1, 24, 64, generator=g), None)
        c(torch.randn(1, 8, 64, generator=g), {"att": state["att"].clone()})
    rows = c.report().classes()
    assert [r["staging_bytes"] for r in rows] == [0]
    pieces = [m for e in c.classes.values() for m in e.gm.modules() if isinstance(m, GuardedPiece)]
    assert pieces and all(p.staging_bytes == 0 for p in pieces)


class CountsCalls(torch.nn.Module):
    """A step that writes an argument in place (a call counter the caller keeps)."""

    def forward(self, x, cache, calls):
        calls.add_(1)
        return x * 2, torch.cat([cache, x], 2)[:, :, -4:]


def test_the_probationary_call_puts_back_an_argument_the_step_writes():
    """A class's first call runs the stock step once as a probe; whatever it wrote in the
    caller's arguments is put back, so the compiled call writes them exactly once, as stock."""
    from cadence_fx.contract import APPEND, Adapter, Region, SlidingWindow
    adapter = Adapter(name="counter", clocks={"W": 4, "c": 2},
                      regions=(Region(name="k", input="cache", output="1", dim=2,
                                      retention=SlidingWindow("W"), advance="c", ordering=APPEND,
                                      shape=(1, 2, None)),),
                      call_frames=("c",), call_input="x", call_dim=2)
    c = cadence_fx.compile(CountsCalls(), adapter)
    calls, state = torch.zeros(()), torch.zeros(1, 2, 0)
    with torch.no_grad():
        for i in range(3):
            _, state = c(torch.randn(1, 2, 2), state, calls)
            assert calls.item() == i + 1
    assert (c.counters.compiled_calls, c.counters.fallbacks) == (3, 0)
