"""The replay guard on one piece, asserted exactly (counters, reasons, log lines), through the
stand-in backend (``replay_stand_in``).

Written against mutants of the replay guard that the stream tests let through
(``bench/mutation.py``, ``bench/results/2026-11-30-mutation.md``)."""
from __future__ import annotations

import logging

import pytest
import torch

import cadence_fx
from cadence_fx.counters import Counters
from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
from cadence_fx.replay import EagerBackend, GuardedPiece
from replay_stand_in import StandInBackend


def _scale(a, w):
    return (a * w,)


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
