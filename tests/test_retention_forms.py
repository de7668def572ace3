"""Every way streaming code keeps a sliding window, rewritten in place on the carry; the priming
pass as a class of its own; a stale state caught; grad/inference modes switching between calls.

Each stream runs the stock module and the compiled one side by side and compares every output
and the state with ``torch.equal``, and asserts that the compiled path ran: every call compiled,
no fallback, the rewrite kinds, no concatenation of the region left in the compiled graphs."""
import dataclasses

import pytest
import torch
from torch import nn

import cadence_fx
from cadence_fx.contract import APPEND, PREPEND, Adapter, Region, SlidingWindow
from cadence_fx.errors import GuardError
from helpers import stream
from streaming_window import FORMS, W, Window, window_step_adapter

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


def _stream(step, xs, device):
    return stream(step, xs, lambda: {"k": torch.zeros(1, 2, 0, 4, device=device)}, "k")


def _cats_left(compiled) -> int:
    from cadence_fx.passes.fx_utils import CATS
    return sum(n.target in CATS for e in compiled.classes.values()
               for m in e.gm.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", FORMS)
def test_every_window_form_is_rewritten_in_place(form, device):
    chunk = W if form == "chunk" else 2
    torch.manual_seed(0)
    model = Window(form).to(device)
    xs = [torch.randn(1, 2, chunk, 4, device=device) for _ in range(10)]
    order = PREPEND if form == "prepend" else APPEND
    compiled = cadence_fx.compile(model, window_step_adapter(order, chunk))
    ours, stock = _stream(compiled, xs, device), _stream(model, xs, device)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ours, stock))
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks, k.carry_addresses) == (len(xs), 0, 1)
    assert k.retentions > 0 and _cats_left(compiled) == 0
    kinds = {w.kind for e in compiled.classes.values() for w in e.records.rewrites
             if w.region == "k"}
    assert kinds == {"append", "retention"}, kinds
    if device == "cuda":
        assert k.replays == len(xs)
    if form == "window-only":   # at the window: 4 kept frames move down in 2 pieces, x written
        (steady,) = [e for key, e in compiled.classes.items() if key[0] == ((W,), 2)]
        copies = [n for m in steady.gm.modules() if isinstance(m, torch.fx.GraphModule)
                  for n in m.graph.nodes if n.target is torch.ops.aten.copy_.default]
        assert len(copies) == 3 and compiled.carries["k"].extent == W + 2


@pytest.mark.parametrize("form", ["slice", "prepend", "window-only"])
def test_the_shadow_auditor_checks_every_window_write(form):
    model = Window(form)
    xs = [torch.randn(1, 2, 2, 4) for _ in range(8)]
    order = PREPEND if form == "prepend" else APPEND
    compiled = cadence_fx.compile(model, window_step_adapter(order), verify=True)
    _stream(compiled, xs, "cpu")
    assert compiled.auditor.comparisons["k"] == len(xs) == compiled.counters.compiled_calls


def test_a_window_without_room_is_copied_with_the_reason(caplog):
    """A region declaring less room than a call adds cannot append in place once the window is
    full: that class copies its state once (materialize), the report says why, a warning says so
    once with the room it needs, and the counters show the copies beside the retentions."""
    base = window_step_adapter(APPEND)
    region = dataclasses.replace(base.regions[0], room="one")
    adapter = dataclasses.replace(base, clocks={**base.clocks, "one": 1}, regions=(region,))
    model = Window("slice")
    compiled = cadence_fx.compile(model, adapter)
    xs = [torch.randn(1, 2, 2, 4) for _ in range(8)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(_stream(compiled, xs, "cpu"), _stream(model, xs, "cpu")))
    full = [e for key, e in compiled.classes.items() if key[0] == ((W,), 2)]
    (entry,) = full
    (write,) = [w for w in entry.records.rewrites if w.region == "k"]
    assert write.kind == "materialize" and "give the region `room`" in write.detail
    assert compiled.counters.fallbacks == 0
    warned = [r.getMessage() for r in caplog.records if "copied whole" in r.getMessage()]
    assert len(warned) == 1 and "region 'k'" in warned[0] and f"class (({W},), 2)" in warned[0]
    assert "more)" in warned[0]
    k = compiled.counters
    assert k.materializations > 0 and k.applications >= k.retentions + k.materializations


class StridedReader(nn.Module):
    """Reads its concatenation through ``as_strided`` at the concatenation's own strides (as
    unfold-style audio framing does): on a view of the carry, which has the carry's strides, the
    same call would read other elements."""

    def forward(self, x, cache):
        full = torch.cat([cache["k"], x], 2)
        framed = full.as_strided(full.shape, full.stride(), full.storage_offset())
        return framed * 2, {"k": full[:, :, -W:]}


def test_a_window_read_through_as_strided_is_copied_with_the_reason():
    model = StridedReader()
    compiled = cadence_fx.compile(model, window_step_adapter(APPEND))
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(1, 2, 2, 4, generator=g) for _ in range(8)]
    ours, stock = _stream(compiled, xs, "cpu"), _stream(model, xs, "cpu")
    assert [torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ours, stock)] == [True] * 8
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks) == (8, 0)
    for key, entry in compiled.classes.items():
        (write,) = [w for w in entry.records.rewrites if w.region == "k"]
        assert write.kind == "materialize", key
        assert "through as_strided at its own strides" in write.detail, write


def test_the_carry_has_one_call_of_room_and_analyze_prices_it():
    catalog = cadence_fx.build_catalog(window_step_adapter(APPEND))
    r = catalog.region("k")
    assert (r.bound, r.room, r.declared_extent) == (W, 2, W + 2)
    assert r.declared_bytes == 1 * 2 * (W + 2) * 4 * 4


# -- the priming pass --------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_the_priming_pass_is_a_class_of_its_own_and_strict_accepts_it(device):
    from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
    model = PromptRetainedToy().to(device)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randn(1, 24, 64, generator=g).to(device) for _ in range(2)]
    chunks = [torch.randn(1, 8, 64, generator=g).to(device) for _ in range(4)]

    def serve(step):
        outs = []
        for prompt in prompts:                    # two speakers, each primed with its own prompt
            with torch.no_grad():
                y, state = step(prompt, None)
                outs.append(y.clone())
                for x in chunks:
                    y, state = step(x, state)
                    outs.append((y.clone(), state["att"].clone()))
        return outs

    stock = serve(model)
    compiled = cadence_fx.compile(PromptRetainedToy().to(device), PROMPT_RETAINED_ADAPTER, strict=True)
    ours = serve(compiled)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else
               torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(stock, ours))
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks, k.carry_addresses) == (10, 0, 1)
    assert k.absorptions == 0        # the priming result is the carry: nothing is copied in
    assert ((None,), 24) in {key[0] for key in compiled.classes}
    if device == "cuda":
        assert k.replays == 10


def test_a_call_that_primes_some_regions_but_not_others_is_refused_with_the_reason():
    from cadence_fx.models.toy import CONV_ADAPTER, ConvLeftContextToy
    compiled = cadence_fx.compile(ConvLeftContextToy(), CONV_ADAPTER, strict=True)
    with torch.no_grad(), pytest.raises(GuardError, match=r"\['att'\] have no input state while"):
        compiled(torch.randn(1, 32, 4), torch.zeros(1, 32, 2), None)


# -- a stale state, and modes that change between calls ----------------------------------------

def test_a_retry_from_an_uncloned_old_state_is_refused_and_a_clone_works():
    model = Window("slice")
    compiled = cadence_fx.compile(model, window_step_adapter(APPEND))
    xs = [torch.randn(1, 2, 2, 4) for _ in range(4)]
    with torch.no_grad():
        _, s1 = compiled(xs[0], {"k": torch.zeros(1, 2, 0, 4)})
        kept = {"k": s1["k"].clone()}
        _, s2 = compiled(xs[1], s1)
        with pytest.raises(GuardError, match="clone"):
            compiled(xs[2], s1)                    # s1 is a view of the carry, overwritten since
        y_retry, _ = compiled(xs[2], kept)         # the clone is foreign state: absorbed
        y_stock, _ = model(xs[2], kept)
    assert torch.equal(y_retry, y_stock)


def test_inference_mode_then_no_grad():
    model = Window("slice")
    compiled = cadence_fx.compile(model, window_step_adapter(APPEND))
    state_c = state_s = {"k": torch.zeros(1, 2, 0, 4)}
    for i in range(6):
        x = torch.randn(1, 2, 2, 4)
        mode = torch.inference_mode() if i % 2 == 0 else torch.no_grad()
        with mode:
            y_c, state_c = compiled(x, state_c)
            y_s, state_s = model(x, state_s)
        assert torch.equal(y_c, y_s) and torch.equal(state_c["k"], state_s["k"])
    assert compiled.counters.compiled_calls == 6


def test_calls_of_several_widths_append_in_place_with_the_default_room():
    """Calls of 4, 6 and 8 frames at an advance of 2 (their gcd) and no declared room: the carry
    holds the window plus the widest call, so every class writes the new frames into its room
    and none copies its state (with the advance as room, the wider classes were materialized)."""
    adapter = Adapter(
        name="window-widths", clocks={"W": W, "s": 2, "c4": 4, "c6": 6, "c8": 8, "heads": 2, "d": 4},
        regions=(Region(name="k", input="cache.k", output="1.k", dim=2, retention=SlidingWindow("W"),
                        advance="s", ordering=APPEND, shape=(1, "heads", None, "d")),),
        call_frames=("c4", "c6", "c8"), call_input="x", call_dim=2)
    model = Window("slice")
    compiled = cadence_fx.compile(model, adapter)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(1, 2, w, 4, generator=g) for w in (4, 6, 8, 4, 8, 6, 6, 8)]
    ours, stock = _stream(compiled, xs, "cpu"), _stream(model, xs, "cpu")
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ours, stock))
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks, k.carry_addresses) == (8, 0, 1)
    assert compiled.carries["k"].extent == W + 8
    kinds = [w.kind for e in compiled.classes.values() for w in e.records.rewrites
             if w.region == "k"]
    assert len(compiled.classes) == 6 and "materialize" not in kinds and "retention" in kinds
    assert not [m for e in compiled.classes.values() for m in e.records.near_misses]
    assert _cats_left(compiled) == 0
