"""Admission's refusals, asserted word for word (``cadence_fx/admission.py``): a call that primes
some regions and not others, a region path naming a key the step's container lacks, an adapter
whose paths do not name the step's arguments (with the registered adapters that would fit).

Written against mutants of the admission code that the stream tests let through
(``bench/mutation.py``, ``bench/results/2026-11-30-mutation.md``)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import cadence_fx
from cadence_fx.admission import check_paths
from cadence_fx.contract import APPEND, Adapter, Region, SlidingWindow


def _region(name, path):
    return Region(name=name, input=path, output=f"1.{name}", dim=2, retention=SlidingWindow("w"),
                  advance="c", ordering=APPEND, shape=(1, 2, None))


def _adapter(*paths, name="two"):
    return Adapter(name=name, clocks={"w": 4, "c": 2},
                   regions=tuple(_region(p.rpartition(".")[2], p) for p in paths),
                   call_frames=("c",), call_input="x", call_dim=2)


class Nested(nn.Module):
    """Two windows kept in ``cache["inner"]``, and one in an optional ``other`` argument."""

    def forward(self, x, cache, other=None):
        inner = cache["inner"]
        out = {k: torch.cat([v, x], 2)[:, :, -4:] for k, v in inner.items()}
        return x * 2, out, other


def _contract_error(paths, keys):
    """The compiled ``Nested`` under regions at ``paths``, called with ``cache["inner"]`` holding
    ``keys``: the step and the contract error's text."""
    c = cadence_fx.compile(Nested(), _adapter(*paths))
    x, a = torch.randn(1, 2, 2), torch.randn(1, 2, 4)
    with pytest.raises(cadence_fx.ContractError) as e:
        c(x, {"inner": {k: a for k in keys}})
    return c, str(e.value)


def test_a_region_key_the_container_lacks_is_a_contract_error_naming_the_select():
    c, error = _contract_error(("cache.inner.a", "cache.inner.b"), "az")
    assert error == (
        "region 'b' of adapter 'two' reads 'cache.inner.b', but the step's 'cache.inner' holds "
        "['a', 'z']; compile with adapter.select('a') or fix the region's `input`")
    assert (c.counters.calls, c.counters.fallbacks, c.counters.traces) == (1, 0, 0)


def test_the_select_names_every_region_the_call_has():
    _, error = _contract_error(("cache.inner.a", "cache.inner.b", "cache.inner.c"), "ab")
    assert error == (
        "region 'c' of adapter 'two' reads 'cache.inner.c', but the step's 'cache.inner' holds "
        "['a', 'b']; compile with adapter.select('a', 'b') or fix the region's `input`")


def test_a_region_in_an_absent_argument_falls_back_with_the_reason():
    c = cadence_fx.compile(Nested(), _adapter("cache.inner.a", "other.b"))
    x, a = torch.randn(1, 2, 2), torch.randn(1, 2, 4)
    with torch.no_grad():
        y, out, other = c(x, {"inner": {"a": a}})
    assert torch.equal(y, x * 2) and torch.equal(out["a"], torch.cat([a, x], 2)[:, :, -4:])
    assert other is None
    assert dict(c.counters.reasons) == {
        "region(s) ['b'] have no input state while the others have: a call primes every region "
        "(the priming pass) or none; pass every region's state, or none to prime": 1}
    assert (c.counters.compiled_calls, c.counters.fallbacks) == (0, 1)


def test_every_region_present_is_admitted_when_the_extents_occur_together():
    c = cadence_fx.compile(Nested(), _adapter("cache.inner.a", "cache.inner.b"))
    x, a, b = torch.randn(1, 2, 2), torch.randn(1, 2, 4), torch.randn(1, 2, 4)
    with torch.no_grad():
        _, out, _ = c(x, {"inner": {"a": a, "b": b}})
        assert torch.equal(out["a"], torch.cat([a, x], 2)[:, :, -4:])
        assert torch.equal(out["b"], torch.cat([b, x], 2)[:, :, -4:])
        assert (c.counters.compiled_calls, c.counters.fallbacks) == (1, 0)
        _, out, _ = c(x, {"inner": {"a": a, "b": b[:, :, :2]}})   # each extent is in its
    assert torch.equal(out["b"], torch.cat([b[:, :, :2], x], 2))   # catalog, not together
    assert dict(c.counters.reasons) == {
        "region extents (4, 2) never occur together in the catalog; pass the states of one "
        "stream (every region's from the same call), or fix the regions' `advance` clocks so "
        "that they move together as the stream does": 1}


def _sig(fn):
    import inspect
    return inspect.signature(fn)


def _refusal(adapter, step) -> str:
    """The ContractError ``check_paths`` raises refusing ``adapter`` for ``step``."""
    with pytest.raises(cadence_fx.ContractError) as e:
        check_paths(adapter, _sig(step))
    return str(e.value)


def test_paths_off_the_arguments_name_the_registered_adapters_that_fit():
    def step(state, pcm):
        pass

    assert _refusal(_adapter("cache.inner.a"), step) == (
        "adapter 'two' does not fit this step: region 'a' reads 'cache.inner.a'; call input "
        "reads 'x', but the step's arguments are ['state', 'pcm']. "
        "Use 'moshi' or 'moshi-mimi' or 'personaplex'.")


def test_paths_off_the_arguments_with_one_region_fitting_suggest_the_select():
    def step(x, cache, *rest):
        pass

    assert _refusal(_adapter("cache.a", "state.b"), step) == (
        "adapter 'two' does not fit this step: region 'b' reads 'state.b', but the step's "
        "arguments are ['x', 'cache']. Use adapter.select('a').")


def test_paths_off_the_arguments_with_nothing_fitting_say_to_fix_the_paths():
    def step(y):
        pass

    assert _refusal(_adapter("cache.a", name="moshi"), step) == (
        "adapter 'moshi' does not fit this step: region 'a' reads 'cache.a'; call input reads "
        "'x', but the step's arguments are ['y']. Fix the paths (`input`, `call_input`) to name "
        "the step's arguments.")


def test_a_registered_adapter_needs_its_call_input_too():
    def step(state, feats, input_ids):
        pass

    assert _refusal(_adapter("cache.a"), step).endswith("Use 'freeze-omni' or 'llm-backbone'.")


def test_a_step_taking_any_keyword_fits_every_adapter():
    def step(**kwargs):
        pass

    assert check_paths(_adapter("cache.a", "state.b"), _sig(step)) is None


# -- the per-call checks and absorption, on one window ----------------------------------------------

def _window(admission=None, shape=(1, 2, None)):
    """A 4-frame window of 2 channels advancing 2 frames a call (catalog extents 0, 2, 4; the carry
    holds 6 frames); with ``admission`` the clock ``a`` = 3 admits widths up to 3."""
    return Adapter(name="win", clocks={"w": 4, "c": 2, "a": 3},
                   regions=(Region(name="k", input="cache", output="1", dim=2,
                                   retention=SlidingWindow("w"), advance="c", ordering=APPEND,
                                   shape=shape),),
                   call_frames=("c",), call_input="x", call_dim=2, admission=admission)


class Window(nn.Module):
    """No weights (so no device or dtype is imposed on the state); reads the first two channels of
    its state, so a state with more channels, the extra ones zero, runs as stock does."""

    def forward(self, x, cache):
        if x is None:
            return None, cache[:, :2].clone()
        return x * 2, torch.cat([cache[:, :2], x], 2)[:, :, -4:]


def _call(c, x, cache):
    """One call, compiled and stock (from a copy of the state, taken first: the compiled call
    may write the carry the state lives in); every result equal."""
    with torch.no_grad():
        want = Window()(x, cache.clone())
        got = c(x, cache)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)
    return got


@pytest.mark.parametrize("admission,width,frames,reason", [
    (None, 2, 3, "region 'k' extent 3 is not in the catalog [0, 2, 4] derived from its retention "
                 "clocks; lower the region's `advance` (c = 2) to 1 (the gcd of the call widths "
                 "[2] and of 3, the frames past 0), so that every extent the stream reaches is in "
                 "the catalog"),
    (None, 3, 2, "call width 3 is neither a declared call width [2] nor admitted (no admission "
                 "clock); declare a clock of 3 in `call_frames`, or an `admission` clock of at "
                 "least 3 for partial calls"),
    ("a", 5, 2, "call width 5 is neither a declared call width [2] nor admitted (admission a = 3); "
                "declare a clock of 5 in `call_frames`, or an `admission` clock of at least 5 for "
                "partial calls"),
], ids=["extent", "width", "width-over-the-admission-clock"])
def test_a_call_outside_the_catalog_runs_stock_with_the_reason(admission, width, frames, reason):
    c = cadence_fx.compile(Window(), _window(admission))
    _call(c, torch.randn(1, 2, width), torch.randn(1, 2, frames))
    assert dict(c.counters.reasons) == {reason: 1}
    assert (c.counters.compiled_calls, c.counters.fallbacks, c.counters.traces) == (0, 1, 0)


def test_a_width_within_the_admission_clock_is_admitted():
    c = cadence_fx.compile(Window(), _window("a"))
    _call(c, torch.randn(1, 2, 3), torch.randn(1, 2, 2))
    assert (c.counters.compiled_calls, c.counters.fallbacks, dict(c.counters.reasons)) == (1, 0, {})


def test_a_missing_call_input_runs_stock_with_the_reason():
    c = cadence_fx.compile(Window(), _window())
    _call(c, None, torch.randn(1, 2, 4))
    assert dict(c.counters.reasons) == {
        "call input 'x' is missing; pass it, or fix the adapter's `call_input`": 1}
    assert (c.counters.compiled_calls, c.counters.fallbacks) == (0, 1)


@pytest.mark.parametrize("shape", [(1, 2), (1, 1, 4), (2, 2, 4), (1, 3, 4)],
                         ids=["rank", "fewer-channels", "more-batch-nonzero", "more-channels-nonzero"])
def test_a_state_contradicting_the_declared_shape_is_a_contract_error(shape):
    c = cadence_fx.compile(Window(), _window())
    with pytest.raises(cadence_fx.ContractError) as e:
        c(torch.randn(1, 2, 2), torch.ones(shape))
    assert str(e.value) == (
        f"region 'k' of adapter 'win' declares shape (1, 2, 'frames') but the step received "
        f"{shape} at 'cache'; fix the region's shape clocks")
    assert c.counters.traces == 0


def test_undeclared_rows_holding_zeros_are_accepted_and_dropped_by_absorption():
    """A third channel of zeros past the two declared: admitted, absorbed as its first two
    channels (the carry holds two), once; the next call passes the handed-out state back."""
    c = cadence_fx.compile(Window(), _window())
    cache = torch.cat([torch.randn(1, 2, 4), torch.zeros(1, 1, 4)], 1)
    state = _call(c, torch.randn(1, 2, 2), cache)[1]
    state = _call(c, torch.randn(1, 2, 2), state)[1]
    assert (c.counters.compiled_calls, c.counters.fallbacks, c.counters.absorptions) == (2, 0, 1)
    assert c.carries["k"].tensor.shape == (1, 2, 6)


def test_without_a_declared_shape_the_carry_takes_the_states_sizes_and_dtype():
    """The carry is allocated once, zero-filled, at the declared extent (6 frames), with the first
    state's other sizes and dtype (float64: the step has no weights to impose one)."""
    c = cadence_fx.compile(Window(), _window(shape=()))
    cache = torch.randn(1, 2, 2, dtype=torch.float64)
    state = _call(c, torch.randn(1, 2, 2, dtype=torch.float64), cache)[1]
    carry = c.carries["k"].tensor
    assert (carry.shape, carry.dtype) == ((1, 2, 6), torch.float64)
    assert torch.equal(carry[:, :, 4:], torch.zeros(1, 2, 2, dtype=torch.float64))
    assert state.data_ptr() == carry.data_ptr()
    _call(c, torch.randn(1, 2, 2, dtype=torch.float64), state)
    assert c.carries["k"].tensor is carry and c.counters.absorptions == 1


def test_a_state_of_another_dtype_than_its_carry_is_a_contract_error():
    c = cadence_fx.compile(Window(), _window())
    _call(c, torch.randn(1, 2, 2), torch.randn(1, 2, 2))
    with pytest.raises(cadence_fx.ContractError) as e:
        c(torch.randn(1, 2, 2, dtype=torch.float64), torch.randn(1, 2, 2, dtype=torch.float64))
    assert str(e.value) == ("region 'k': state arrived as torch.float64 on cpu, but its carry is "
                            "torch.float32 on cpu (the stream's first state fixed it); pass the "
                            "state as state.to('cpu', torch.float32), or compile another step for "
                            "torch.float64 states")


def test_an_old_view_of_the_carry_is_refused_as_stale():
    c = cadence_fx.compile(Window(), _window())
    first = _call(c, torch.randn(1, 2, 2), torch.randn(1, 2, 2))[1]
    _call(c, torch.randn(1, 2, 2), first)
    with pytest.raises(cadence_fx.GuardError) as e:
        c(torch.randn(1, 2, 2), first)
    assert str(e.value) == (
        "region 'k': this state is a view of the carry, but not the one the last call returned; "
        "the carry was overwritten since. To retry a chunk, keep state.clone() (or copy.deepcopy "
        "of the state) before the call and pass the clone")


def test_a_state_inside_the_carry_at_an_offset_is_absorbed_through_a_copy():
    """The last two frames of the handed-out state live in the carry, overlapping where they are
    absorbed to (its first frames): they are copied out first, and the call runs as stock."""
    c = cadence_fx.compile(Window(), _window())
    state = _call(c, torch.randn(1, 2, 2), torch.randn(1, 2, 4))[1]
    tail = state[:, :, 1:3]
    assert tail.untyped_storage().data_ptr() == c.carries["k"].tensor.untyped_storage().data_ptr()
    _call(c, torch.randn(1, 2, 2), tail)
    assert (c.counters.compiled_calls, c.counters.fallbacks, c.counters.absorptions) == (2, 0, 2)


def test_the_carry_is_allocated_on_the_states_device():
    """A step without weights imposes no device: state on the meta device gets a carry there,
    and the compiled call runs there (the only other device a CPU run has)."""
    c = cadence_fx.compile(Window(), _window())
    x, cache = torch.randn(1, 2, 2, device="meta"), torch.randn(1, 2, 4, device="meta")
    with torch.no_grad():
        y, state = c(x, cache)
    carry = c.carries["k"].tensor
    assert (carry.device.type, carry.shape, y.device.type, state.shape) == (
        "meta", (1, 2, 6), "meta", (1, 2, 4))
    assert (c.counters.compiled_calls, c.counters.fallbacks, c.counters.absorptions) == (1, 0, 1)


class ScaledWindow(Window):
    """The window with a weight (on the CPU); without a state it primes: the state is x."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x, cache):
        if cache is None:
            return x * self.scale, x.clone()
        return super().forward(x * self.scale, cache)


def test_a_priming_call_without_state_still_has_its_call_input_checked():
    """No region state (the priming pass) is nothing to check; the call input after it still is."""
    c = cadence_fx.compile(ScaledWindow(), _window())
    with pytest.raises(cadence_fx.ContractError) as e:
        c(torch.randn(1, 2, 2, device="meta"), None)
    assert str(e.value) == ("call input 'x' is on meta, but the step's weights are on cpu; move it "
                            "with .to('cpu')")
    assert c.counters.traces == 0


# -- paths with more than one dot, a call input off the arguments, and a too-wide catalog ----------

def test_a_call_input_deeper_than_one_key_fits_by_its_first_name():
    """``call_input`` ``batch.feats.x`` names the argument ``batch``: it fits (only the first name
    of a path is an argument)."""
    def step(batch, cache):
        pass

    adapter = Adapter(name="deep", clocks={"w": 4, "c": 2},
                      regions=(_region("a", "cache.inner.a"),), call_frames=("c",),
                      call_input="batch.feats.x", call_dim=2)
    assert check_paths(adapter, _sig(step)) is None


def test_regions_deeper_than_one_key_that_fit_are_named_in_the_select():
    """Two regions under ``cache.inner`` fit a step taking ``cache``; the one in ``state`` does
    not: the select names both that fit, comma-separated."""
    def step(x, cache):
        pass

    assert _refusal(_adapter("cache.inner.a", "cache.inner.b", "state.c"), step) == (
        "adapter 'two' does not fit this step: region 'c' reads 'state.c', but the step's "
        "arguments are ['x', 'cache']. Use adapter.select('a', 'b').")


def test_every_region_fitting_but_the_call_input_suggests_no_select():
    """Every region fits and only the call input does not: a select would drop nothing, so none
    is suggested."""
    def step(cache):
        pass

    assert _refusal(_adapter("cache.a", "cache.b"), step) == (
        "adapter 'two' does not fit this step: call input reads 'x', but the step's arguments are "
        "['cache']. Fix the paths (`input`, `call_input`) to name the step's arguments.")


WIDE = ("region 'a' has K = 3 signature classes, over the width limit 1 (Criterion 3.5); "
        "region 'b' has K = 3 signature classes, over the width limit 1 (Criterion 3.5): "
        "the step runs stock; raise the adapter's `width_limit` to 3 if that many classes may "
        "be compiled, or leave the stage to an outer scheduler")


def _wide():
    import dataclasses
    return dataclasses.replace(_adapter("cache.inner.a", "cache.inner.b"), width_limit=1)


def test_a_catalog_over_the_width_limit_runs_stock_with_the_reason_logged(caplog):
    """Both regions have 3 extents (0, 2, 4) over a width limit of 1: the compile logs why, once,
    word for word, and every call runs stock with that reason."""
    import logging
    with caplog.at_level(logging.WARNING, logger="cadence_fx.admission"):
        c = cadence_fx.compile(Nested(), _wide())
    assert [r.getMessage() for r in caplog.records if r.name == "cadence_fx.admission"] == [WIDE]
    x, a = torch.randn(1, 2, 2), torch.randn(1, 2, 4)
    with torch.no_grad():
        y, out, _ = c(x, {"inner": {"a": a, "b": a}})
    assert torch.equal(y, x * 2) and torch.equal(out["b"], torch.cat([a, x], 2)[:, :, -4:])
    assert dict(c.counters.reasons) == {WIDE: 1}
    assert (c.counters.compiled_calls, c.counters.fallbacks) == (0, 1)


def test_a_catalog_over_the_width_limit_is_refused_in_strict_mode():
    with pytest.raises(cadence_fx.GuardError) as e:
        cadence_fx.compile(Nested(), _wide(), strict=True)
    assert str(e.value) == f"strict mode: {WIDE}"


class Square(nn.Module):
    """A 4-frame window of 4 channels: a state and its transpose have the same shape."""

    def forward(self, x, cache):
        return x * 2 + cache.sum(2, keepdim=True), torch.cat([cache, x], 2)[:, :, -4:]


def test_a_state_that_is_the_carry_transposed_is_absorbed_through_a_copy():
    """The handed-out state transposed is a view of the carry with other strides (not the state
    the step handed out, nor stale): absorbing it copies it into the carry it lives in, every
    element from another place. It is copied out first, so the call runs as stock does on the
    transposed values (copied in place, the first rows written would be read back as columns).
    The step sums it, so its bits may depend on the layout: the call runs stock on the transposed
    view, its values put back, with the reason."""
    c = cadence_fx.compile(Square(), _window(shape=(1, 4, None)))
    g = torch.Generator().manual_seed(2)
    x0, x1, cache = (torch.randn(1, 4, n, generator=g) for n in (2, 2, 4))
    with torch.no_grad():
        state = c(x0, cache)[1]
        turned = state.transpose(1, 2)
        assert turned.untyped_storage().data_ptr() == c.carries["k"].tensor.untyped_storage().data_ptr()
        want = Square()(x1, turned.clone())
        got = c(x1, turned)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (c.counters.compiled_calls, c.counters.fallbacks, c.counters.absorptions) == (1, 1, 2)
    (reason,) = c.counters.reasons
    assert reason.startswith("region 'k' arrives with strides (24, 1, 6)") and "aten.sum" in reason
