"""An LLM backbone decoding one token per call under a 2,000-token sliding-window KV cache.

This adapter exists to be rejected: it is the paper's negative case (Table 3). The window makes the
cache bounded (C2 holds), but the extent advances one token per call from an empty cache, so the step
sees every extent 0, 1, ..., 2000: K = (2000 - 0) / 1 + 1 = 2001 classes (eq. 7), far above the default
``width_limit`` of 64. ``build_catalog`` reports it as not admissible (Criterion 3.5); such phases are
left to an outer serving scheduler.

Sizes are those of a Qwen2-7B-class decoder (the backbone Freeze-Omni freezes): 28 layers, grouped-query
attention with 4 key/value heads of 128, bf16. They set bytes only, never K.

Paths: ``step(input_ids, state) -> (logits, state)``, ``input_ids`` of shape (batch, 1), and
``state.kv`` of shape (layers, 2, batch, kv_heads, frames, head_dim) with new tokens appended.
"""
from __future__ import annotations

from cadence_fx.contract import APPEND, Adapter, Region, SlidingWindow

__all__ = ["ADAPTERS", "CLOCKS", "LLM_BACKBONE"]

CLOCKS = {
    "token": 1, "window": 2000,
    "layers": 28, "kv_heads": 4, "head_dim": 128, "batch": 1,
}

KV = Region(
    name="kv", input="state.kv", output="1.kv", dim=4,
    retention=SlidingWindow("window"), advance="token", ordering=APPEND,
    shape=("layers", 2, "batch", "kv_heads", None, "head_dim"), element_bytes=2)

LLM_BACKBONE = Adapter(
    name="llm-backbone",
    clocks=CLOCKS,
    regions=(KV,),
    call_frames=("token",),
    call_input="input_ids", call_dim=1,
    description="LLM backbone, one token per call, 2,000-token sliding window: K = 2001, excluded",
)

ADAPTERS = {"llm-backbone": LLM_BACKBONE}
