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


def test_a_region_key_the_container_lacks_is_a_contract_error_naming_the_select():
    c = cadence_fx.compile(Nested(), _adapter("cache.inner.a", "cache.inner.b"))
    x, a = torch.randn(1, 2, 2), torch.randn(1, 2, 4)
    with pytest.raises(cadence_fx.ContractError) as e:
        c(x, {"inner": {"a": a, "z": a}})
    assert str(e.value) == (
        "region 'b' of adapter 'two' reads 'cache.inner.b', but the step's 'cache.inner' holds "
        "['a', 'z']; compile with adapter.select('a') or fix the region's `input`")
    assert (c.counters.calls, c.counters.fallbacks, c.counters.traces) == (1, 0, 0)


def test_the_select_names_every_region_the_call_has():
    c = cadence_fx.compile(Nested(), _adapter("cache.inner.a", "cache.inner.b", "cache.inner.c"))
    x, a = torch.randn(1, 2, 2), torch.randn(1, 2, 4)
    with pytest.raises(cadence_fx.ContractError) as e:
        c(x, {"inner": {"a": a, "b": a}})
    assert str(e.value) == (
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
        "(the priming pass) or none": 1}
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
        "region extents (4, 2) never occur together in the catalog": 1}


def _sig(fn):
    import inspect
    return inspect.signature(fn)


def test_paths_off_the_arguments_name_the_registered_adapters_that_fit():
    def step(state, pcm):
        pass

    with pytest.raises(cadence_fx.ContractError) as e:
        check_paths(_adapter("cache.inner.a"), _sig(step))
    assert str(e.value) == (
        "adapter 'two' does not fit this step: region 'a' reads 'cache.inner.a'; call input "
        "reads 'x', but the step's arguments are ['state', 'pcm']. "
        "Use 'moshi' or 'moshi-mimi' or 'personaplex'.")


def test_paths_off_the_arguments_with_one_region_fitting_suggest_the_select():
    def step(x, cache, *rest):
        pass

    with pytest.raises(cadence_fx.ContractError) as e:
        check_paths(_adapter("cache.a", "state.b"), _sig(step))
    assert str(e.value) == (
        "adapter 'two' does not fit this step: region 'b' reads 'state.b', but the step's "
        "arguments are ['x', 'cache']. Use adapter.select('a').")


def test_paths_off_the_arguments_with_nothing_fitting_say_to_fix_the_paths():
    def step(y):
        pass

    with pytest.raises(cadence_fx.ContractError) as e:
        check_paths(_adapter("cache.a", name="moshi"), _sig(step))
    assert str(e.value) == (
        "adapter 'moshi' does not fit this step: region 'a' reads 'cache.a'; call input reads "
        "'x', but the step's arguments are ['y']. Fix the paths (`input`, `call_input`) to name "
        "the step's arguments.")


def test_a_registered_adapter_needs_its_call_input_too():
    def step(state, feats, input_ids):
        pass

    with pytest.raises(cadence_fx.ContractError) as e:
        check_paths(_adapter("cache.a"), _sig(step))
    assert str(e.value).endswith("Use 'freeze-omni' or 'llm-backbone'.")


def test_a_step_taking_any_keyword_fits_every_adapter():
    def step(**kwargs):
        pass

    assert check_paths(_adapter("cache.a", "state.b"), _sig(step)) is None
