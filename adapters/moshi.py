"""Moshi and PersonaPlex (same architecture): Mimi codec + a 7B streaming LM with ring KV caches.

Numbers from ``moshi==0.2.13`` (``moshi/models/loaders.py``: ``_lm_kwargs``, ``_transformer_kwargs``,
``_seanet_kwargs``, ``get_mimi``, ``get_moshi_lm``), checked against a Mimi built with random weights:

- One call is one frame: 12.5 Hz, 1920 samples at 24 kHz. Mimi's SEANet hop is 960 samples, so its
  transformers run at 25 Hz and advance 2 steps per call; the LM advances 1 step per call.
- LM: 32 layers, 32 heads, dim 4096 (head dim 128), ``context`` 3000, bf16 (``get_moshi_lm``'s default
  dtype). Each layer's ``RingKVCache.cache`` is (2, batch, heads, capacity=context, head_dim), written
  in place by ``index_copy_``/``scatter_`` at ``end_offset % capacity``; attention always reads all
  ``capacity`` slots (positions mask the unwritten ones), so the attended extent is constant: K = 1.
- Mimi encoder and decoder transformers: 8 layers, 8 heads, d_model 512 (head dim 64), ``context`` 250,
  fp32 (``get_mimi`` builds fp32): the same ring, K = 1.
- Mimi conv left-context: ``StreamingConv1d`` keeps ``previous`` of ``kernel - stride`` frames,
  zero-filled at full size when streaming starts and overwritten with ``x[..., -TP:]`` each call.
  The representative region is the encoder's input conv (``encoder.model.0``: 1 channel, kernel 7,
  stride 1: 6 samples). Its extent never changes (start = window), K = 1. The other conv and
  conv-transpose states (``previous`` and ``partial`` of the SEANet blocks, the 25 Hz down/upsampling
  convs) are of the same kind and are declared when the step functions that expose them are written.
- ``LMGen``'s delayed-token cache (batch, n_q + 1 = 17, max_delay + 2 = 3) int64, written in place at
  ``offset % 3``: a ring of 3 columns, K = 1.

The depformer's KV cache (context 8) is scratch: ``LMGen`` enters and leaves ``depformer.streaming``
within every step, so it is not persistent state and is not declared. Sampling draws device randomness
(``exponential_``/``multinomial`` on the LM's device), hence ``Effects(device_rng=True)``.

Steps (``cadence_fx/models/moshi.py``, thin wrappers that bind an explicit state dict into the stock
streaming dataclasses): ``MoshiStep.forward(pcm, state) -> (pcm_out, tokens, state)`` for the
full frame (Mimi encode, ``LMGen._step``, Mimi decode) and ``MimiStep.forward(pcm, state) ->
(codes, pcm_out, state)`` for the codec alone (adapter ``moshi-mimi``). ``pcm`` is (batch, 1, 1920)
fp32; the regions are entries of ``state`` (result 2, written in place):

- ``state.lm_kv``: (lm_layers, 2, batch, lm_heads, lm_context, lm_head_dim) bf16, the 32 per-layer ring
  caches stacked (each layer's ``RingKVCache.cache`` a view of one slice, so the carry *is* the ring).
- ``state.mimi_encoder_kv`` / ``state.mimi_decoder_kv``: (mimi_layers, 2, batch, mimi_heads, 250, 64).
- ``state.mimi_conv_in``: (batch, 1, 6), the encoder input conv's ``previous``.
- ``state.lm_token_ring``: (batch, 17, 3) int64, ``LMGen``'s delayed-token cache.

The rest of the stock state (ring write offsets, conv ``previous``/``partial`` of the inner SEANet
layers, execution masks: a few hundred bytes each) travels in the same dict as plain arguments.
``step.initial_state()`` gives a fresh state (the first one is the modules' own streaming caches;
the step keeps no second copy), ``step.reset_state(state)`` starts a turn in place, as the stock
loop's ``reset_streaming`` does (on a compiled step nothing is copied then).

Stock shapes equal the declared ones (rho = 1): these caches are already right-sized by the vendor, so
here the carry degenerates to the vendor's ring buffers, as the paper notes.
"""
from __future__ import annotations

import dataclasses

from cadence_fx.contract import APPEND, Adapter, Effects, Region, Ring, SlidingWindow

__all__ = ["ADAPTERS", "CLOCKS", "MOSHI", "MIMI", "PERSONAPLEX"]

CLOCKS = {
    # time: one call = one 12.5 Hz frame = 1920 samples at 24 kHz
    "frame_samples": 1920, "lm_steps_per_call": 1, "mimi_steps_per_call": 2, "batch": 1,
    # LM (_lm_kwargs): dim 4096 / 32 heads = 128 per head, ring context 3000
    "lm_layers": 32, "lm_heads": 32, "lm_head_dim": 128, "lm_context": 3000,
    # Mimi transformers (_transformer_kwargs): d_model 512 / 8 heads = 64 per head, context 250
    "mimi_layers": 8, "mimi_heads": 8, "mimi_head_dim": 64, "mimi_context": 250,
    # Mimi encoder input conv (_seanet_kwargs: channels 1, kernel_size 7, stride 1): 7 - 1 = 6 samples
    "audio_channels": 1, "conv_in_left": 6,
    # LMGen delayed-token cache: n_q + 1 = 17 streams, max_delay + 2 = 3 columns
    "token_streams": 17, "token_ring": 3,
}

_LM_KV_SHAPE = ("lm_layers", 2, "batch", "lm_heads", None, "lm_head_dim")
_MIMI_KV_SHAPE = ("mimi_layers", 2, "batch", "mimi_heads", None, "mimi_head_dim")

LM_KV = Region(
    name="lm_kv", input="state.lm_kv", output="2.lm_kv", dim=4,
    retention=Ring("lm_context"), advance="lm_steps_per_call", ordering=APPEND,
    shape=_LM_KV_SHAPE, element_bytes=2,
    stock_shape=("lm_layers", 2, "batch", "lm_heads", "lm_context", "lm_head_dim"))
MIMI_ENCODER_KV = Region(
    name="mimi_encoder_kv", input="state.mimi_encoder_kv", output="2.mimi_encoder_kv", dim=4,
    retention=Ring("mimi_context"), advance="mimi_steps_per_call", ordering=APPEND,
    shape=_MIMI_KV_SHAPE,
    stock_shape=("mimi_layers", 2, "batch", "mimi_heads", "mimi_context", "mimi_head_dim"))
MIMI_DECODER_KV = dataclasses.replace(
    MIMI_ENCODER_KV, name="mimi_decoder_kv", input="state.mimi_decoder_kv",
    output="2.mimi_decoder_kv")
MIMI_CONV_IN = Region(
    name="mimi_conv_in", input="state.mimi_conv_in", output="2.mimi_conv_in", dim=2,
    # zero-filled at full size when streaming starts: the extent is the window from the first call
    retention=SlidingWindow("conv_in_left", start="conv_in_left"), advance="frame_samples",
    ordering=APPEND, shape=("batch", "audio_channels", None),
    stock_shape=("batch", "audio_channels", "conv_in_left"))
LM_TOKEN_RING = Region(
    name="lm_token_ring", input="state.lm_token_ring", output="2.lm_token_ring", dim=2,
    retention=Ring("token_ring"), advance="lm_steps_per_call", ordering=APPEND,
    shape=("batch", "token_streams", None), element_bytes=8,
    stock_shape=("batch", "token_streams", "token_ring"))

MOSHI = Adapter(
    name="moshi",
    clocks=CLOCKS,
    regions=(LM_KV, MIMI_ENCODER_KV, MIMI_DECODER_KV, MIMI_CONV_IN, LM_TOKEN_RING),
    call_frames=("frame_samples",),
    call_input="pcm", call_dim=-1,
    effects=Effects(device_rng=True),
    description="Moshi: Mimi codec (12.5 Hz, 24 kHz) + 7B streaming LM with ring KV caches",
)

PERSONAPLEX = dataclasses.replace(
    MOSHI, name="personaplex",
    description="PersonaPlex: Moshi architecture (Mimi codec + 7B LM with ring KV caches)")

MIMI = dataclasses.replace(
    MOSHI, name="moshi-mimi", regions=(MIMI_ENCODER_KV, MIMI_DECODER_KV, MIMI_CONV_IN),
    effects=Effects(),
    description="Mimi codec alone: streaming encode + decode of one 1920-sample frame")

ADAPTERS = {"moshi": MOSHI, "moshi-mimi": MIMI, "personaplex": PERSONAPLEX}
