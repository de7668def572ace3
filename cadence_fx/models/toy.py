"""Small streaming models, one per retention kind, written the way the real stock code is.

* ``PromptRetainedToy`` -- Token2Wav-style: attention with new frames *prepended* to the cache, the
  new cache written by slice assignment into an over-sized ``att_cache_buffer`` (the stock
  envelope) and returned as a view of it, then retention to prompt + last ``retained`` frames with
  ``torch.cat`` of two slices.
* ``RingToy`` -- Moshi-style: a ring KV cache of fixed capacity written in place at
  ``(offset + t) % capacity`` by ``index_copy_``.
* ``NoisySourceToy`` -- HiFT-style: device randomness drawn on every call.
* ``HostRandomToy`` -- draws Python ``random``: host randomness, rejected.
* ``ConvLeftContextToy`` -- Freeze-Omni-style: a causal conv whose left context is the tail of
  ``cat([cache, x])``, plus attention over one chunk of left context (extents {0, chunk}).

Each comes with its adapter (``*_ADAPTER``). They are the demo's default model and the tests'
fixtures; weights are seeded random.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cadence_fx.contract import (APPEND, PREPEND, Adapter, Effects, PromptRetained, Region, Ring,
                                 SlidingWindow)

__all__ = ["PromptRetainedToy", "RingToy", "ConvLeftContextToy", "PROMPT_RETAINED_ADAPTER",
           "RING_ADAPTER", "CONV_ADAPTER", "TOY_CLOCKS", "NoisySourceToy", "NOISY_ADAPTER",
           "HostRandomToy"]

TOY_CLOCKS = {"f_prompt": 24, "f_retained": 16, "f_chunk": 8, "f_call": 10, "layers": 2, "heads": 4,
              "kv_width": 32, "batch": 1, "stock_frames": 128}


class PromptRetainedToy(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2, prompt: int = 24,
                 retained: int = 16, envelope_frames: int = 128, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.heads, self.head_dim, self.prompt, self.retained = heads, dim // heads, prompt, retained
        self.inp = nn.Linear(dim, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        self.register_buffer("att_cache_buffer",
                             torch.zeros(layers, 1, heads, envelope_frames, 2 * self.head_dim),
                             persistent=False)

    def forward(self, x: torch.Tensor, cache=None):
        """x: (1, T, dim); cache: {"att": (layers, 1, heads, frames, 2 * head_dim)} or None."""
        b, t, _ = x.shape
        h = self.inp(x)
        att = cache["att"] if cache is not None else None
        held = att.shape[3] if att is not None else 0
        for i, (qkv, proj) in enumerate(zip(self.qkv, self.proj)):
            q, k, v = (z.reshape(b, t, self.heads, self.head_dim).transpose(1, 2)
                       for z in qkv(h).chunk(3, dim=-1))
            if att is not None:
                k_cache, v_cache = att[i].chunk(2, dim=-1)
                k = torch.cat([k, k_cache], dim=2)  # prepend: new frames first
                v = torch.cat([v, v_cache], dim=2)
            new_cache = torch.cat([k, v], dim=-1)
            o = F.scaled_dot_product_attention(q, k, v)
            h = h + proj(o.transpose(1, 2).reshape(b, t, -1))
            self.att_cache_buffer[i][:, :, :held + t, :] = new_cache
        state = self.att_cache_buffer[:, :, :, :held + t, :]
        if state.shape[3] > self.prompt + self.retained:
            state = torch.cat([state[:, :, :, :self.prompt], state[:, :, :, -self.retained:]], dim=3)
        return h, {"att": state}


PROMPT_RETAINED_ADAPTER = Adapter(
    name="toy-prompt-retained", clocks=TOY_CLOCKS,
    regions=(Region(name="att", input="cache.att", output="1.att", dim=3,
                    retention=PromptRetained("f_prompt", "f_retained"), advance="f_chunk",
                    ordering=PREPEND, shape=("layers", "batch", "heads", None, "kv_width"),
                    stock_shape=("layers", "batch", "heads", "stock_frames", "kv_width"),
                    envelope="att_cache_buffer", room="f_call"),),
    call_frames=("f_chunk", "f_call"), call_input="x", call_dim=1, admission="f_chunk",
    description="Token2Wav-style toy: prepend attention cache, prompt + retained history")


class RingToy(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2, capacity: int = 16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.heads, self.head_dim, self.capacity = heads, dim // heads, capacity
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x: torch.Tensor, kv: torch.Tensor, offset: torch.Tensor):
        """x: (1, T, dim); kv: (2, 1, heads, capacity, head_dim) written in place; offset: (1,) long."""
        b, t, _ = x.shape
        q, k, v = (z.reshape(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, dim=-1))
        idx = (torch.arange(t, device=x.device) + offset) % self.capacity
        kv[0].index_copy_(2, idx, k)
        kv[1].index_copy_(2, idx, v)
        pos = torch.arange(self.capacity, device=x.device)
        written = offset + t
        valid = (pos < written) | (written > self.capacity)
        mask = valid.view(1, 1, 1, -1).expand(b, self.heads, t, self.capacity)
        o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(b, t, -1)), kv, offset + t


RING_ADAPTER = Adapter(
    name="toy-ring", clocks={"capacity": 16, "f_chunk": 1, "heads": 2, "head_dim": 16, "batch": 1},
    regions=(Region(name="kv", input="kv", output="1", dim=3, retention=Ring("capacity"),
                    advance="f_chunk", ordering=APPEND,
                    shape=(2, "batch", "heads", None, "head_dim")),),
    call_frames=("f_chunk",), call_input="x", call_dim=1, admission="f_chunk",
    description="Moshi-style toy: ring KV cache written in place")


class ConvLeftContextToy(nn.Module):
    def __init__(self, dim: int = 32, kernel: int = 3, chunk: int = 4, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.context, self.chunk = kernel - 1, chunk
        self.conv = nn.Conv1d(dim, dim, kernel)
        self.qkv = nn.Linear(dim, 3 * dim)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x: torch.Tensor, conv_cache: torch.Tensor, att_cache: torch.Tensor):
        """x: (1, dim, T); conv_cache: (1, dim, kernel-1); att_cache: (1, 2 * dim, frames <= chunk)."""
        xc = torch.cat([conv_cache, x], dim=2)
        new_conv_cache = xc[:, :, -self.context:]
        y = self.conv(xc).transpose(1, 2)  # (1, T, dim)
        q, k, v = self.qkv(y).chunk(3, dim=-1)
        kv = torch.cat([att_cache, torch.cat([k, v], dim=-1).transpose(1, 2)], dim=2)
        k_all, v_all = kv.transpose(1, 2).chunk(2, dim=-1)
        o = F.scaled_dot_product_attention(q.unsqueeze(1), k_all.unsqueeze(1), v_all.unsqueeze(1))
        new_att_cache = kv[:, :, -self.chunk:]
        return o.squeeze(1).transpose(1, 2), new_conv_cache, new_att_cache


CONV_ADAPTER = Adapter(
    name="toy-conv-left-context", clocks={"kernel_context": 2, "f_chunk": 4, "dim": 32, "kv": 64,
                                          "batch": 1},
    regions=(Region(name="conv", input="conv_cache", output="1", dim=2,
                    retention=SlidingWindow("kernel_context", start="kernel_context"),
                    advance="f_chunk", ordering=APPEND, shape=("batch", "dim", None)),
             Region(name="att", input="att_cache", output="2", dim=2,
                    retention=SlidingWindow("f_chunk"), advance="f_chunk", ordering=APPEND,
                    shape=("batch", "kv", None))),
    call_frames=("f_chunk",), call_input="x", call_dim=2, admission="f_chunk",
    description="Freeze-Omni-style toy: conv left context and one chunk of attention context")


class NoisySourceToy(nn.Module):
    """HiFT-style: a conv with a left-context cache and a harmonic source that draws device
    randomness on every call (``torch.rand`` for the phase, ``randn_like`` twice for the noise)."""

    def __init__(self, dim: int = 16, kernel: int = 3, harmonics: int = 4, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.context, self.harmonics = kernel - 1, harmonics
        self.conv = nn.Conv1d(dim, dim, kernel)
        self.f0 = nn.Linear(dim, 1)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x: torch.Tensor, cache: torch.Tensor):
        """x: (1, dim, T); cache: (1, dim, kernel-1)."""
        xc = torch.cat([cache, x], dim=2)
        h = self.conv(xc)
        f0 = torch.sigmoid(self.f0(h.transpose(1, 2))) * 0.1              # (1, T, 1)
        mult = torch.arange(1, self.harmonics + 1, device=x.device, dtype=x.dtype)
        phase = torch.rand(1, 1, self.harmonics, device=x.device)        # random initial phase
        sines = torch.sin(torch.cumsum(f0 * mult, dim=1) * 2 * torch.pi + phase)
        noise = 0.003 * torch.randn_like(sines) + 0.01 * torch.randn_like(sines)
        return h + (sines + noise).sum(-1).unsqueeze(1), xc[:, :, -self.context:]


NOISY_ADAPTER = Adapter(
    name="toy-noisy-source", clocks={"context": 2, "f_chunk": 8, "dim": 16, "batch": 1},
    regions=(Region(name="conv", input="cache", output="1", dim=2,
                    retention=SlidingWindow("context", start="context"), advance="f_chunk",
                    ordering=APPEND, shape=("batch", "dim", None)),),
    call_frames=("f_chunk",), call_input="x", call_dim=2, admission="f_chunk",
    effects=Effects(device_rng=True),
    description="HiFT-style toy: device randomness on every call")


class HostRandomToy(ConvLeftContextToy):
    """Scales its output by a number drawn from Python's ``random``: host randomness, which a
    trace would freeze into a constant."""

    def forward(self, x, conv_cache, att_cache):
        import random
        y, conv_cache, att_cache = super().forward(x, conv_cache, att_cache)
        return y * (1.0 + random.random()), conv_cache, att_cache
