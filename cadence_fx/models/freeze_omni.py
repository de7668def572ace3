"""A Freeze-Omni-style streaming speech encoder (no package exists): conv subsampling + chunked
attention with a bounded left-context cache, written the way the public streaming inference code
runs it (WeNet-style ``forward_chunk``), under a fixed chunk policy.

Per call the encoder takes 16 new fbank frames (80 bins). The 4x ``Conv2dSubsampling4`` front end
(two 3x3 stride-2 convs) needs 3 frames of left context, kept from the previous chunk
(``conv_left``, zero at the start of a turn): 3 + 16 = 19 frames give 4 encoder frames. Each
attention layer appends its chunk's keys and values to its cache with ``torch.cat`` and keeps the
last ``left_chunks * 4`` frames -- the stock cache grows by concatenation and is sliced back every
call, a new tensor each time. Attention inside a chunk is full; the cached frames are all visible.
Positions come from a sinusoidal table indexed by a frame ``offset`` tensor, so a chunk's graph
does not depend on where in the turn it falls.

``FreezeOmniEncoder.forward(feats, state) -> (enc_out, state)`` with ``state`` a dict
``{"att_cache": (layers, 2, batch, heads, frames, head_dim), "conv_left": (batch, 3, 80),
"offset": (1,) int64}``; ``initial_state()`` is the start of a turn (an empty attention cache).
The adapter is ``adapters/freeze_omni.py`` (K = 2: extents {0, 4} with one left chunk).
"""
from __future__ import annotations

import math
from typing import Dict

import torch
from torch import nn

__all__ = ["FreezeOmniEncoder", "REAL_CONFIG"]

# the operating point of adapters/freeze_omni.py: 24 blocks, 1024 wide, 16 heads, 80-bin fbank
REAL_CONFIG = dict(layers=24, dim=1024, heads=16, ffn=4096, bins=80, chunk=16, left_chunks=1)


class Conv2dSubsampling4(nn.Module):
    """(batch, frames, bins) -> (batch, ((frames - 1) // 2 - 1) // 2, dim)."""

    def __init__(self, bins: int, dim: int):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, dim, 3, 2), nn.ReLU(), nn.Conv2d(dim, dim, 3, 2), nn.ReLU())
        self.out = nn.Linear(dim * (((bins - 1) // 2 - 1) // 2), dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.shape
        return self.out(x.transpose(1, 2).reshape(b, t, c * f))


class ChunkAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def infer(self, x: torch.Tensor, cache: torch.Tensor, keep: int):
        """``cache``: (2, batch, heads, cached, head_dim). Returns the output and the new cache:
        the cached and new keys/values concatenated, the last ``keep`` frames kept."""
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        k = torch.cat([cache[0], k], dim=2)
        v = torch.cat([cache[1], v], dim=2)
        new_cache = torch.stack([k, v])[:, :, :, -keep:] if keep > 0 else cache[:, :, :, :0]
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.o(out.transpose(1, 2).reshape(b, t, -1)), new_cache


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.att = ChunkAttention(dim, heads)
        self.ff = nn.Sequential(nn.Linear(dim, ffn), nn.SiLU(), nn.Linear(ffn, dim))

    def infer(self, x, cache, keep):
        y, new_cache = self.att.infer(self.norm1(x), cache, keep)
        x = x + y
        return x + self.ff(self.norm2(x)), new_cache


class FreezeOmniEncoder(nn.Module):
    def __init__(self, layers: int = 24, dim: int = 1024, heads: int = 16, ffn: int = 4096,
                 bins: int = 80, chunk: int = 16, left_chunks: int = 1, max_frames: int = 6000,
                 seed: int = 0):
        super().__init__()
        self.dim, self.heads, self.bins, self.chunk = dim, heads, bins, chunk
        self.conv_left = 3                        # Conv2dSubsampling4's receptive field - stride
        self.enc_chunk = chunk // 4
        self.keep = self.enc_chunk * left_chunks  # left context kept by every attention layer
        self.embed = Conv2dSubsampling4(bins, dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        position = torch.arange(max_frames).unsqueeze(1)
        freq = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
        pe = torch.zeros(max_frames, dim)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * freq), torch.cos(position * freq)
        self.register_buffer("pe", pe, persistent=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                r = torch.randn(p.shape, generator=g)
                p.copy_(r / max(1, p[0].numel()) ** 0.5 if p.dim() > 1
                        else (0.02 * r if name.endswith("bias") else 1 + 0.02 * r))

    def initial_state(self, batch: int = 1) -> Dict[str, torch.Tensor]:
        device = self.pe.device
        head_dim = self.dim // self.heads
        return {"att_cache": torch.zeros(len(self.layers), 2, batch, self.heads, 0, head_dim, device=device),
                "conv_left": torch.zeros(batch, self.conv_left, self.bins, device=device),
                "offset": torch.zeros(1, dtype=torch.long, device=device)}

    def forward(self, feats: torch.Tensor, state: Dict[str, torch.Tensor]):
        x = torch.cat([state["conv_left"], feats], dim=1)   # (batch, 3 + 16, bins)
        conv_left = x[:, -self.conv_left:]
        x = self.embed(x)                                     # (batch, 4, dim)
        t = x.shape[1]
        pos = self.pe.index_select(0, state["offset"] + torch.arange(t, device=x.device))
        x = x * math.sqrt(self.dim) + pos
        caches = []
        for i, layer in enumerate(self.layers):
            x, cache = layer.infer(x, state["att_cache"][i], self.keep)
            caches.append(cache)
        return self.norm(x), {"att_cache": torch.stack(caches), "conv_left": conv_left,
                              "offset": state["offset"] + t}
