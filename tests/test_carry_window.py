"""The window rewrite of the carry pass (``passes/_carry_window.py``) on the forms, dims and
orders the stream tests do not reach, asserted exactly: every output and state ``torch.equal`` to
the stock step over a stream (the window growing, then steady), every call compiled, and each
class's rewrite record (kind and detail, word for word).

* frame dim 0, where ``cat``, ``split`` and an all-default ``slice`` leave their dim out of the
  traced call, and ``narrow`` from a negative start;
* an empty window at the end of the concatenation, and parts of it split or chunked;
* a ``narrow`` along another dim that keeps all of it, on the way to the window;
* prepend order with nothing but the window reading the concatenation, and with the old state
  read after the concatenation;
* the reasons a state is not a window (a fresh tail, three parts, the carry's own frames as the
  new ones, a ``split`` of a fresh result, a ``topk``, joins along another dim), a concatenation
  written in place, a carry without room;
* a reader that cannot take a view of the carry: the rewrite is rolled back, nodes, moves and
  fake values (which the next region reads), and the state is copied once;
* ``fake_mode`` of a graph whose first value is a real tensor.

Written against mutants of the window rewrite that the stream tests let through
(``bench/mutation.py``, ``.mutation/ledger/run-J-survivors.txt``)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import cadence_fx
from cadence_fx.contract import APPEND, PREPEND, Adapter, Region, SlidingWindow

ATEN = torch.ops.aten
W = 6
NOT_A_WINDOW = "the new state is not a window of a concatenation along the frame dim"


def _adapter(dim, shape, order=APPEND, c=2, room=0):
    """One sliding window ``k`` of ``W`` frames along ``dim``, ``c`` frames a call (the call input
    ``x`` along the same dim); ``room`` > 0 gives the carry that many frames of room."""
    clocks = {"W": W, "c": c, **({"r": room} if room else {})}
    return Adapter(name="window", clocks=clocks,
                   regions=(Region(name="k", input="cache", output="1", dim=dim,
                                   retention=SlidingWindow("W"), advance="c", ordering=order,
                                   shape=shape, **({"room": "r"} if room else {})),),
                   call_frames=("c",), call_input="x", call_dim=dim)


def _stream(model, adapter, xs, empty):
    """The compiled step and the stock module side by side over ``xs``, each from its own last
    state: every output and state equal; every call compiled. Returns the compiled step."""
    compiled = cadence_fx.compile(model, adapter)
    ours = ref = empty
    for x in xs:
        with torch.no_grad():
            (y, ours), (y_ref, ref) = compiled(x, ours), model(x, ref)
        assert torch.equal(y, y_ref) and torch.equal(ours, ref)
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks, dict(k.reasons)) == (len(xs), 0, {})
    return compiled


def _records(compiled):
    """``{frames held: [(kind, detail), ...]}`` of the region's rewrites, per class."""
    return {key[0][0][0]: [(r.kind, r.detail) for r in e.records.rewrites
                           if r.region == "k"]
            for key, e in compiled.classes.items()}


def _xs(shape, calls=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(calls)]


def _window_records(l_c):
    """The records of an append window of ``W`` frames growing 2 frames a call from 0."""
    out = {}
    for l in l_c:
        lo = max(0, l + 2 - W)
        out[l] = [("retention" if lo else "append",
                   f"cat (append, {l} + 2 frames) became in-place writes; its window "
                   f"[{lo}, {l + 2}) is C[:{min(W, l + 2)}]")]
    return out


# -- frame dim 0: the dim left out of the traced call --------------------------------------------

class Dim0(nn.Module):
    """A window of the last ``W`` rows (frame dim 0) of ``cat([cache, x])``, taken as ``form``:
    ``cat`` and ``split`` (sizes, or one size) along their default dim, an ``aten.slice`` with
    every argument left out while the window fills, ``narrow`` from a negative start."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, x, cache):
        full = torch.cat([cache, x])
        n = full.shape[0]
        keep = min(W, n)
        if self.form == "split":
            new = full.split([n - keep, keep])[1]
        elif self.form == "split-int":      # split(n), one part, while the window fills
            new = full.split(keep)[-1] if n % keep == 0 else full[-W:]
        elif self.form == "all-default-slice":
            new = ATEN.slice.Tensor(full) if n <= W else full[-W:]
        elif self.form == "narrow-negative":
            new = full.narrow(0, -keep, keep)
        else:
            new = full[-W:]
        return (full * 2).sum(0, keepdim=True) + new.mean(0, keepdim=True), new


@pytest.mark.parametrize("form", ["slice", "split", "split-int", "all-default-slice",
                                  "narrow-negative"])
def test_a_window_along_frame_dim_0_is_rewritten_whatever_its_form(form):
    """``torch.cat([cache, x])``, ``full.split(sizes)`` and ``aten.slice(full)`` trace without a
    dim (0 is their default); ``narrow(0, -keep, keep)`` keeps a negative start: each is seen as
    the window of the last ``W`` rows, bit-exact, written in place."""
    compiled = _stream(Dim0(form), _adapter(0, (None, 4)), _xs((2, 4)), torch.zeros(0, 4))
    assert _records(compiled) == _window_records([0, 2, 4, 6])


class EmptyAtTheEnd(nn.Module):
    """Keeps no frames: the state is ``full.narrow(2, n, 0)``, the empty window at the end, or a
    part of it split (``split(0)``, allowed of an empty dim) or chunked."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, x, cache):
        full = torch.cat([cache, x], 2)
        new = full.narrow(2, full.shape[2], 0)
        if self.form == "split-0":
            new = new.split(0, 2)[0]
        elif self.form == "chunk":
            new = new.chunk(2, 2)[1]
        return (full * 2).sum(2, keepdim=True), new


@pytest.mark.parametrize("form,record", [
    ("narrow", ("retention", "cat (append, 0 + 2 frames) became in-place writes; its window "
                             "[2, 2) is C[:0]")),
    ("split-0", ("materialize", f"new state (0 frames) written into C[:0]: copied once, because "
                                f"{NOT_A_WINDOW}")),
    ("chunk", ("materialize", f"new state (0 frames) written into C[:0]: copied once, because "
                              f"{NOT_A_WINDOW}")),
])
def test_an_empty_window_at_the_end_of_the_concatenation(form, record):
    """``narrow`` starting at the concatenation's length (length 0): the record places the empty
    window at ``[2, 2)``, where the step takes it, not at 0. A part of it split or chunked has
    no sizes to take (parts of an empty dim): it is no window, and is copied (nothing)."""
    compiled = _stream(EmptyAtTheEnd(form), _adapter(2, (1, 2, None)), _xs((1, 2, 2), calls=3),
                       torch.zeros(1, 2, 0))
    assert _records(compiled) == {0: [record]}


# -- a narrow along another dim on the way to the window ------------------------------------------

class Channels(nn.Module):
    """Frame dim 2; the window is taken of ``full.narrow(1, 0, 2)``: every channel, a no-op."""

    def forward(self, x, cache):
        full = torch.cat([cache, x], 2)
        new = full.narrow(1, 0, 2)[:, :, -W:]
        return (full * 2).sum(2, keepdim=True) + new.mean(2, keepdim=True), new


def test_a_narrow_that_keeps_all_of_another_dim_is_seen_through():
    """A narrow along dim 1 that keeps both channels leaves the window a window of the
    concatenation: written in place, not copied."""
    compiled = _stream(Channels(), _adapter(2, (1, 2, None)), _xs((1, 2, 2)), torch.zeros(1, 2, 0))
    assert _records(compiled) == _window_records([0, 2, 4, 6])


# -- prepend order ---------------------------------------------------------------------------------

class Prepend(nn.Module):
    """``cat([x, cache], 2)[:, :, :W]``: ``window-only`` reads nothing but the window, taken with
    ``narrow`` (a traced node even while it keeps every frame); ``reads-old`` reads the old state
    after the concatenation too."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, x, cache):
        full = torch.cat([x, cache], 2)
        if self.form == "window-only":
            new = full.narrow(2, 0, min(W, full.shape[2]))
            return new.softmax(2).sum(2, keepdim=True), new
        new = full[:, :, :W]
        return new.softmax(2).sum(2, keepdim=True) + cache.sum(2, keepdim=True), new


def _prepend_records(kind_detail):
    return {l: [kind_detail(l)] for l in (0, 2, 4, 6)}


def test_a_prepend_window_read_alone_is_written_at_the_front():
    """Prepend order with nothing but the window reading the concatenation: the old frames move
    up and ``x`` is written at ``C[:2]`` (no append-order move-first), bit-exact."""
    compiled = _stream(Prepend("window-only"), _adapter(2, (1, 2, None), order=PREPEND),
                       _xs((1, 2, 2)), torch.zeros(1, 2, 0))
    assert _records(compiled) == _prepend_records(lambda l: (
        "retention" if l == W else "append",
        f"cat (prepend, {l} + 2 frames) became in-place writes; its window [0, {min(W, l + 2)}) "
        f"is C[:{min(W, l + 2)}]"))


def test_a_prepend_whose_old_state_is_read_after_it_is_copied_with_the_reason():
    """The old state is read after the concatenation prepends to it: moving it up in place would
    change what that read sees, so the state is copied, with the reason."""
    compiled = _stream(Prepend("reads-old"), _adapter(2, (1, 2, None), order=PREPEND),
                       _xs((1, 2, 2)), torch.zeros(1, 2, 0))
    assert _records(compiled) == _prepend_records(lambda l: (
        "materialize", f"new state ({min(W, l + 2)} frames) written into C[:{min(W, l + 2)}]: "
        "copied once, because sum_2 reads the old state after cat prepends to it"))


# -- why a state is not a window, word for word ----------------------------------------------------

class NotAWindow(nn.Module):
    """A state of ``W`` frames (frame dim 2) that is not a window of the old state and ``x``,
    in one of the ways streaming code could write it; each is copied into the carry once."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, x, cache):
        full = torch.cat([cache, x], 2)
        n = full.shape[2]
        keep = min(W, n)
        f = self.form
        if f == "fresh-tail":                 # a tail of a computed result
            new = (full * 2)[:, :, -W:]
        elif f == "three-parts":
            new = torch.cat([cache, x, x], 2)[:, :, -W:]
        elif f == "split-of-fresh":
            new = (full * 2).split([n - keep, keep], 2)[1]
        elif f == "topk":                     # a getitem, but of no split
            new = full.topk(keep, dim=2)[0]
        elif f == "channels-joined":          # each channel computed, joined along dim 1
            new = torch.cat([full[:, :1, -W:] * 2, full[:, 1:, -W:] * 3], 1)
        elif f == "channel-halves":           # partial slices of dim 1, joined along it
            new = torch.cat([full.narrow(1, 0, 1)[:, :, -W:], full.narrow(1, 1, 1)[:, :, -W:]], 1)
        elif f == "split-channels":           # split parts of dim 1, joined along it
            new = torch.cat([p[:, :, -W:] for p in full.split(1, 1)], 1)
        else:                                 # "carry-as-new": new frames that are old ones
            new = torch.cat([cache, cache[:, :, -2:] if cache.shape[2] else x], 2)[:, :, -W:]
        return new.sum(2, keepdim=True) + x.sum(2, keepdim=True), new


NO_JOIN = " is neither a join of windows nor a window of a concatenation"
WHY = {
    "fresh-tail": NOT_A_WINDOW,
    "three-parts": "cat_1 joins 3 tensors, not the old state and the new frames",
    "split-of-fresh": NOT_A_WINDOW,
    "topk": NOT_A_WINDOW,
    "channels-joined": f"{NOT_A_WINDOW}; mul{NO_JOIN}",
    "channel-halves": f"{NOT_A_WINDOW}; slice_1{NO_JOIN}",
    "split-channels": f"{NOT_A_WINDOW}; slice_1{NO_JOIN}",
    "carry-as-new": "cat_1's new frames slice_1 are a view of the carry",
}


@pytest.mark.parametrize("form", sorted(WHY))
def test_a_state_that_is_no_window_is_copied_once_with_the_reason(form):
    """The state at the window (6 + 2 frames) is not a window of the old state and ``x``: the
    class copies it into the carry once, bit-exact, and the record says why, word for word."""
    compiled = _stream(NotAWindow(form), _adapter(2, (1, 2, None)), _xs((1, 2, 2)),
                       torch.zeros(1, 2, 0))
    assert _records(compiled)[W] == [
        ("materialize",
         f"new state (6 frames) written into C[:6]: copied once, because {WHY[form]}")]
    if form == "carry-as-new":   # 2 + 2 frames: both parts are the old state C[:2]
        assert _records(compiled)[2] == [
            ("materialize", "new state (4 frames) written into C[:4]: copied once, because cat_1 "
                            "does not join the old state C[:l] with new frames")]


# -- a concatenation written in place; a carry without room ----------------------------------------

class WritesTheConcatenation(nn.Module):
    """The step zeroes the first frame of its concatenation in place after taking the window."""

    def forward(self, x, cache):
        full = torch.cat([cache, x], 2)
        new = full[:, :, -W:]
        full.narrow(2, 0, 1).zero_()
        return (full * 2).sum(2, keepdim=True) + new.mean(2, keepdim=True), new


class Rollback(nn.Module):
    """A reader that needs the concatenation's own layout, which a view of the carry does not
    have: ``view(1, -1)`` of a contiguous concatenation, while a leading slice of the carry, which
    holds more frames, is not contiguous. ``append``: ``full`` is read so; ``prepend``: the same
    of ``cat([x, cache])``; ``window-only``: only the window (``narrow``) is read, so while it
    is contiguous (the window filling), reshaped once not."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, x, cache):
        if self.form == "prepend":
            full = torch.cat([x, cache], 2)
            new = full[:, :, :W]
            return full.view(1, -1).sum(1) + new.sum(), new
        full = torch.cat([cache, x], 2)
        if self.form == "window-only":
            n = full.shape[2]
            new = full.narrow(2, n - min(W, n), min(W, n))
            flat = new.view(1, -1) if new.is_contiguous() else new.reshape(1, -1)
            return flat.softmax(1).sum(1), new
        new = full[:, :, -W:]
        return full.view(1, -1).sum(1) + new.sum(), new


def test_a_concatenation_written_in_place_is_copied_with_the_reason():
    """The step writes its concatenation in place (after taking the window): the concatenation
    cannot become a view of the carry, so every class copies its state, with the writer named."""
    compiled = _stream(WritesTheConcatenation(), _adapter(2, (1, 2, None)), _xs((1, 2, 2)),
                       torch.zeros(1, 2, 0))
    assert _records(compiled) == {l: [(
        "materialize", f"new state ({min(W, l + 2)} frames) written into C[:{min(W, l + 2)}]: "
        "copied once, because zero_ writes the concatenation in place")] for l in (0, 2, 4, 6)}


def test_a_window_without_room_for_a_call_names_the_frames_it_would_hold():
    """One frame of room (a carry of 7 rows) for 2-frame calls: at the window the concatenation
    holds 6 + 2 = 8 frames, one more than the carry: the record says so, word for word."""
    compiled = _stream(Dim0("slice"), _adapter(0, (None, 4), room=1), _xs((2, 4)),
                       torch.zeros(0, 4))
    assert _records(compiled)[W] == [(
        "materialize", "new state (6 frames) written into C[:6]: copied once, because cat holds 8 "
        "frames before the window drops any, but the carry holds 7; give the region `room` for a "
        "call's frames (1 more)")]


VIEW_ERROR = ("RuntimeError: view size is not compatible with input tensor's size and stride (at "
              "least one dimension spans across two contiguous subspaces). Use .reshape(...) "
              "instead.")
COPY, CLONE = torch.ops.aten.copy_.default, torch.ops.aten.clone.default


@pytest.mark.parametrize("form,order,room,rolled_back", [
    ("append", APPEND, 0, (0, 2, 4)),
    ("window-only", APPEND, 0, (0, 2, 4)),
    ("prepend", PREPEND, 4, (0, 2, 4, 6)),
])
def test_a_reader_that_cannot_view_the_carry_rolls_the_rewrite_back(form, order, room,
                                                                      rolled_back):
    """Where a reader of the concatenation (or, moved first, of the window) cannot take a view
    of the carry, the rewrite is undone -- its copies, views and moves (prepend: the old frames
    moving up, in pieces or through a temporary), the fake values it changed -- and the state
    is copied once: bit-exact, one copy in the class and no temporary (the state's fake value is
    the concatenation's again, not a view of the carry), the reason word for word."""
    compiled = _stream(Rollback(form), _adapter(2, (1, 2, None), order=order, room=room),
                       _xs((1, 2, 2), calls=8), torch.zeros(1, 2, 0))
    records = _records(compiled)
    for l in rolled_back:
        frames = min(W, l + 2)
        assert records[l] == [(
            "materialize", f"new state ({frames} frames) written into C[:{frames}]: copied once, "
            f"because a reader cannot take a view of the carry ({VIEW_ERROR})")]
        (entry,) = [e for key, e in compiled.classes.items() if key[0][0] == (l,)]
        graph = entry.records.graph or entry.gm
        assert sum(n.target is COPY for n in graph.graph.nodes) == 1
        assert sum(n.target is CLONE for n in graph.graph.nodes) == 0
    if W not in rolled_back:
        assert records[W] == _window_records([W])[W]


class TwoWindows(nn.Module):
    """Two windows: ``a``'s concatenation is read by ``view(1, -1)`` (rolled back while the
    window fills), ``b``'s is plain; ``b`` is rewritten after ``a``."""

    def forward(self, x, cache):
        fa, fb = torch.cat([cache["a"], x], 2), torch.cat([cache["b"], x * 2], 2)
        na, nb = fa[:, :, -W:], fb[:, :, -W:]
        return fa.view(1, -1).sum(1) + na.sum() + (fb * 2).sum(), {"a": na, "b": nb}


def test_a_rolled_back_window_leaves_the_fake_values_the_next_region_reads():
    """After ``a``'s rewrite is rolled back, every node has its traced fake value again: ``b``,
    rewritten next, is written in place in every class, and no class falls back."""
    def region(name):
        return Region(name=name, input=f"cache.{name}", output=f"1.{name}", dim=2,
                      retention=SlidingWindow("W"), advance="c", ordering=APPEND,
                      shape=(1, 2, None))

    adapter = Adapter(name="two", clocks={"W": W, "c": 2}, regions=(region("a"), region("b")),
                      call_frames=("c",), call_input="x", call_dim=2)
    model = TwoWindows()
    compiled = cadence_fx.compile(model, adapter)
    ours = ref = {"a": torch.zeros(1, 2, 0), "b": torch.zeros(1, 2, 0)}
    for x in _xs((1, 2, 2), calls=8):
        with torch.no_grad():
            (y, ours), (y_ref, ref) = compiled(x, ours), model(x, ref)
        assert torch.equal(y, y_ref) and all(torch.equal(ours[k], ref[k]) for k in "ab")
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks, dict(k.reasons)) == (8, 0, {})
    kinds = {key[0][0]: [(r.region, r.kind) for r in e.records.rewrites]
             for key, e in compiled.classes.items()}
    assert kinds == {(l, l): [("a", "materialize"), ("b", "append")] for l in (0, 2, 4)} | {
        (W, W): [("a", "retention"), ("b", "retention")]}


def test_the_fake_mode_is_that_of_the_first_fake_value():
    """A node whose value is a real tensor (no fake mode) is passed over: the fake mode is the
    first fake value's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cadence_fx.passes._carry_graph import fake_mode

    gm = torch.fx.symbolic_trace(nn.ReLU())
    mode = FakeTensorMode()
    first, second = list(gm.graph.nodes)[:2]
    first.meta["val"] = torch.zeros(2)
    with mode:
        second.meta["val"] = torch.empty(2)
    assert fake_mode(gm) is mode
