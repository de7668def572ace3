"""A step that draws from its device's torch generator must declare it (``Effects(device_rng=True)``):
a ``SessionPool`` gives each session its own generator state only then, and makes the lanes of
such a step take turns on the device. The draw is seen at the class's probationary call; an
undeclared one is a ``ContractError`` naming the fix, never a pool whose sessions share one
generator. The Token2Wav flow draws none (its CFM noise is a fixed buffer) and declares none."""
import dataclasses

import pytest
import torch

import cadence_fx
from cadence_fx.contract import Effects
from cadence_fx.errors import ContractError
from streaming_decoder import DECODER_ADAPTER, StreamingDecoder, chunks, make_decoder, prompt


class _Noisy(StreamingDecoder):
    """The decoder with a draw that leaves the output as it is (times zero) but moves the
    generator."""

    def forward(self, x, state=None):
        out, new = super().forward(x, state)
        return out + 0.0 * torch.randn_like(out), new


def _noisy():
    model = _Noisy()
    model.load_state_dict(make_decoder().state_dict())
    return model.eval()


def _first_calls(compiled, model):
    with torch.inference_mode():
        _, state = model(prompt(0), None)
        return compiled(chunks([8], 1)[0], state)


def test_an_undeclared_draw_is_refused_with_the_fix():
    model = _noisy()
    compiled = cadence_fx.compile(model, DECODER_ADAPTER)
    with pytest.raises(ContractError, match=r"device_rng=True") as err:
        _first_calls(compiled, model)
    assert "_Noisy" in str(err.value) and DECODER_ADAPTER.name in str(err.value)


def test_a_declared_draw_compiles():
    model = _noisy()
    adapter = dataclasses.replace(DECODER_ADAPTER, effects=Effects(device_rng=True))
    compiled = cadence_fx.compile(model, adapter)
    _first_calls(compiled, model)
    assert compiled.counters.compiled_calls == 1 and compiled.counters.fallbacks == 0


def test_a_step_without_draws_compiles_undeclared():
    model = make_decoder()
    compiled = cadence_fx.compile(model, DECODER_ADAPTER)
    _first_calls(compiled, model)
    assert compiled.counters.compiled_calls == 1


def test_the_token2wav_flow_declares_no_randomness_and_the_vocoder_does():
    from cadence_fx import adapters
    assert not adapters.get("minicpmo-token2wav-flow").effects.device_rng
    assert adapters.get("minicpmo-token2wav-hift").effects.device_rng
