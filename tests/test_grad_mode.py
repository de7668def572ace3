"""Grad mode: a call that would build an autograd graph in stock (grad enabled, a weight or an
input that requires grad) runs the stock step, counted with the reason, so its results require
grad as stock's do; ``strict=True`` refuses it with an error naming ``torch.inference_mode()``.
Never a compiled result with another ``requires_grad`` than stock's."""
import pytest
import torch

import cadence_fx
from cadence_fx.errors import GuardError
from cadence_fx.models.toy import RING_ADAPTER, RingToy

WEIGHT = ("grad mode is on and weight 'qkv.weight' requires grad, so the stock step builds an "
          "autograd graph (its results require grad), which a compiled call does not: the stock "
          "step runs; call the step under torch.inference_mode() (or torch.no_grad()), or freeze "
          "the weights with module.requires_grad_(False)")


def _args(seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, 32, generator=g).requires_grad_(requires_grad)
    return x, torch.zeros(2, 1, 2, 16, 16), torch.zeros(1, dtype=torch.long)


def _same(ours, stock):
    assert torch.equal(ours[0], stock[0]) and ours[0].requires_grad == stock[0].requires_grad


def test_a_call_that_would_build_a_graph_runs_stock_with_the_reason():
    stock, compiled = RingToy(), cadence_fx.compile(RingToy(), RING_ADAPTER)
    want, got = stock(*_args()), compiled(*_args())
    assert want[0].requires_grad and got[0].requires_grad and got[0].grad_fn is not None
    _same(got, want)
    k = compiled.counters
    assert (k.calls, k.compiled_calls, k.fallbacks, k.traces) == (1, 0, 1, 0)
    assert dict(k.reasons) == {WEIGHT: 1}
    # the same call under no_grad or inference_mode compiles: no result requires grad either way
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            _same(compiled(*_args(1)), stock(*_args(1)))
    assert (k.compiled_calls, k.fallbacks, dict(k.reasons)) == (2, 1, {WEIGHT: 1})


def test_frozen_weights_compile_in_grad_mode_and_an_input_that_requires_grad_runs_stock():
    stock, model = RingToy().requires_grad_(False), RingToy().requires_grad_(False)
    compiled = cadence_fx.compile(model, RING_ADAPTER)
    got, want = compiled(*_args()), stock(*_args())
    assert not got[0].requires_grad and not want[0].requires_grad
    _same(got, want)
    assert (compiled.counters.compiled_calls, compiled.counters.fallbacks) == (1, 0)
    got, want = compiled(*_args(2, requires_grad=True)), stock(*_args(2, requires_grad=True))
    assert got[0].requires_grad and want[0].requires_grad
    _same(got, want)
    (reason,) = compiled.counters.reasons
    assert reason.startswith("grad mode is on and input 'x' requires grad")
    assert (compiled.counters.compiled_calls, compiled.counters.fallbacks) == (1, 1)


def test_strict_mode_refuses_it_naming_inference_mode():
    compiled = cadence_fx.compile(RingToy(), RING_ADAPTER, strict=True)
    with pytest.raises(GuardError, match=r"strict mode: grad mode is on .* call the step under "
                                         r"torch\.inference_mode\(\)"):
        compiled(*_args())
    assert (compiled.counters.compiled_calls, compiled.counters.traces) == (0, 0)
    with torch.inference_mode():
        compiled(*_args())
    assert compiled.counters.compiled_calls == 1
