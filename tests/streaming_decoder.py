"""A chunked streaming decoder that writes its caches through preallocated module workspaces, its
adapter, and helpers for the server script that drives it.

A test vehicle of our own (none of the supported families), written the way production decoders
that predate explicit state keep theirs:

- the input is embedded and given a learned position per frame, looked up at
  ``where(pos < MAX_POS, pos, full_like(pos, MAX_POS - 1)).clamp(0, MAX_POS - 1)`` with
  ``pos = offset + arange(t)`` and ``offset`` the frames the speaker has sent (an int64 tensor of
  the state: integer arithmetic on the device, as ring offsets are);
- each layer is attention -> causal conv with bias -> LayerNorm -> SiLU;
- attention concatenates the new keys and values in front of the cached ones
  (``k = cat([k_new, k_cache], 2)``), attends to all of them, and writes
  ``cat([k, v], -1)`` into the layer's slice of the workspace ``kv_buffer``; the new state is
  copied out of it, cut to the first ``PROMPT`` and the last ``RETAINED`` frames once it is longer;
- the conv keeps a two-frame left context, written into ``conv_buffer`` and copied out; its
  output goes through a transpose into the norm (a strided input).

``StreamingDecoder.forward(x, state) -> (out, new_state)``: ``x`` is (batch, frames, BINS),
``state`` ``{"kv": (layers, batch, heads, frames, 2 * head_dim), "conv": (layers, batch, d_model,
2), "offset": (1,) int64}`` or None for a speaker's priming pass (``PROMPT`` frames). The state returned is a tensor
of its own, never a view of the workspaces.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from cadence_fx.contract import APPEND, PREPEND, Adapter, PromptRetained, Region, Ring
from helpers import seed_weights

__all__ = ["StreamingDecoder", "DECODER_ADAPTER", "make_decoder", "prompt", "chunks", "clone"]

LAYERS, D_MODEL, HEADS, BINS, MAX_POS = 2, 64, 4, 40, 40
PROMPT, RETAINED, CHUNK, CALL, BUFFER = 16, 8, 8, 12, 64
HEAD_DIM = D_MODEL // HEADS


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.out = nn.Linear(D_MODEL, D_MODEL)
        self.conv = nn.Conv1d(D_MODEL, D_MODEL, 3)      # causal: two frames of left context
        self.norm = nn.LayerNorm(D_MODEL)

    def forward(self, h, kv_cache: Optional[torch.Tensor], conv_cache: Optional[torch.Tensor],
                kv_out: torch.Tensor, conv_out: torch.Tensor):
        b, t, _ = h.shape
        q, k, v = (z.reshape(b, t, HEADS, HEAD_DIM).transpose(1, 2)
                   for z in self.qkv(h).chunk(3, dim=-1))
        if kv_cache is not None:
            k_cache, v_cache = kv_cache.chunk(2, dim=-1)
            k = torch.cat([k, k_cache], dim=2)
            v = torch.cat([v, v_cache], dim=2)
        kv = torch.cat([k, v], dim=-1)
        o = F.scaled_dot_product_attention(q, k, v)
        kv_out[:, :, :kv.shape[2], :] = kv
        h = h + self.out(o.transpose(1, 2).reshape(b, t, -1))
        c = h.transpose(1, 2)
        if conv_cache is None:
            conv_cache = c.new_zeros(b, D_MODEL, 2)
        ctx = torch.cat([conv_cache, c], dim=2)
        conv_out.copy_(ctx[:, :, -2:])
        y = self.norm(self.conv(ctx).transpose(1, 2))
        return h + F.silu(y)


class StreamingDecoder(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        self.embed = nn.Linear(BINS, D_MODEL)
        self.pos = nn.Embedding(MAX_POS, D_MODEL)
        self.layers = nn.ModuleList(_Layer() for _ in range(LAYERS))
        self.proj = nn.Linear(D_MODEL, BINS)
        self.register_buffer("kv_buffer", torch.zeros(LAYERS, 1, HEADS, BUFFER, 2 * HEAD_DIM),
                             persistent=False)
        self.register_buffer("conv_buffer", torch.zeros(LAYERS, 1, D_MODEL, 2), persistent=False)
        seed_weights(self, seed)

    def forward(self, x: torch.Tensor, state: Optional[Dict[str, torch.Tensor]] = None):
        b, t, _ = x.shape
        held = state["kv"].shape[3] if state is not None else 0
        offset = state["offset"] if state is not None else torch.zeros(1, dtype=torch.long,
                                                                       device=x.device)
        pos = offset + torch.arange(t, device=x.device)
        pos = torch.where(pos < MAX_POS, pos, torch.full_like(pos, MAX_POS - 1)).clamp(0, MAX_POS - 1)
        h = self.embed(x) + self.pos(pos)
        for i, layer in enumerate(self.layers):
            h = layer(h, state["kv"][i] if state is not None else None,
                      state["conv"][i] if state is not None else None,
                      self.kv_buffer[i], self.conv_buffer[i])
        kv = self.kv_buffer[:, :, :, :held + t]
        if kv.shape[3] > PROMPT + RETAINED:
            kv = torch.cat([kv[:, :, :, :PROMPT], kv[:, :, :, -RETAINED:]], dim=3)
        else:
            kv = kv.clone()          # the state never aliases the workspace
        return self.proj(h), {"kv": kv, "conv": self.conv_buffer.clone(), "offset": offset + t}


CLOCKS = {"prompt": PROMPT, "retained": RETAINED, "chunk": CHUNK, "call": CALL, "layers": LAYERS,
          "batch": 1, "heads": HEADS, "kv_width": 2 * HEAD_DIM,
          "context": 2, "d_model": D_MODEL}

DECODER_ADAPTER = Adapter(
    name="streaming-decoder",
    clocks=CLOCKS,
    regions=(
        Region(name="kv", input="state.kv", output="1.kv", dim=3,
               retention=PromptRetained("prompt", "retained"), advance="chunk", ordering=PREPEND,
               shape=("layers", "batch", "heads", None, "kv_width")),
        Region(name="conv", input="state.conv", output="1.conv", dim=3,
               retention=Ring("context"), advance="chunk", ordering=APPEND,
               shape=("layers", "batch", "d_model", None)),
    ),
    call_frames=("chunk", "call"), call_input="x", call_dim=1, admission="chunk",
    description="chunked streaming decoder writing its caches through module workspaces",
)


def make_decoder(seed: int = 0) -> StreamingDecoder:
    return StreamingDecoder(seed=seed).eval()


def prompt(speaker: int) -> torch.Tensor:
    return torch.randn(1, PROMPT, BINS, generator=torch.Generator().manual_seed(500 + speaker))


def chunks(widths: List[int], seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, w, BINS, generator=g) for w in widths]


def clone(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}
