"""A speaker-prompted streaming acoustic decoder whose caches keep the prompt and the recent
history by concatenating, then cutting: the append-then-cut prompt-retained form.

A test vehicle of our own (none of the supported families), written the way TTS decoders that
condition on a spoken prompt keep their caches:

- text tokens are embedded and the speaker's prosody history, pooled over its frames, is added;
- each layer is pre-norm attention -> causal depthwise conv with a two-frame left context -> FFN;
- attention keeps per-layer K and V caches as ``k_all = cat([k_cache, k_new], 2)`` and attends
  to all of them; once ``k_all`` holds more than ``PROMPT + RETAINED`` frames it is cut to
  ``cat([k_all[:, :, :PROMPT], k_all[:, :, -RETAINED:]], 2)``;
- the prosody history is read once at the start of a call and then kept the same way, from the
  decoder's output projected to ``HIST`` channels: only the cut reads its concatenation;
- ``order="prepend"`` concatenates the new frames in front (``cat([new, cache])``) and cuts to
  ``cat([all[..., :RETAINED], all[..., -PROMPT:]])``: the newest frames, then the prompt.

``PromptDecoder.forward(tokens, state) -> (mel, new_state)``: ``tokens`` is (1, frames) int64,
``state`` ``{"k0", "v0", ...: (1, HEADS, frames, HEAD_DIM), "conv0", ...: (1, D_MODEL, 2),
"hist": (1, HIST, frames)}`` or None for a speaker's priming pass (``PROMPT`` tokens).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from cadence_fx.contract import APPEND, Adapter, PromptRetained, Region, SlidingWindow
from helpers import seed_weights

__all__ = ["PromptDecoder", "prompt_adapter", "make_decoder", "serve", "served", "LAYERS",
           "PROMPT", "RETAINED", "CHUNK", "FLUSH"]

LAYERS, D_MODEL, HEADS, HIST, VOCAB, BINS = 2, 48, 4, 16, 96, 20
PROMPT, RETAINED, CHUNK, FLUSH = 12, 20, 4, 2
HEAD_DIM = D_MODEL // HEADS

State = Dict[str, torch.Tensor]


def _cut(order: str, both: torch.Tensor) -> torch.Tensor:
    """Prompt + history: cut once longer than ``PROMPT + RETAINED`` frames."""
    if both.shape[2] <= PROMPT + RETAINED:
        return both
    if order == APPEND:
        return torch.cat([both[:, :, :PROMPT], both[:, :, -RETAINED:]], 2)
    return torch.cat([both[:, :, :RETAINED], both[:, :, -PROMPT:]], 2)


def _join(order: str, cache: Optional[torch.Tensor], new: torch.Tensor) -> torch.Tensor:
    if cache is None:
        return new
    return _cut(order, torch.cat([cache, new], 2) if order == APPEND else torch.cat([new, cache], 2))


class _Layer(nn.Module):
    def __init__(self, order: str):
        super().__init__()
        self.order = order
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv, self.out = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
        self.conv = nn.Conv1d(D_MODEL, D_MODEL, 3, groups=D_MODEL)
        self.ffn = nn.Sequential(nn.Linear(D_MODEL, 2 * D_MODEL), nn.GELU(),
                                 nn.Linear(2 * D_MODEL, D_MODEL))

    def _attend(self, h, k_cache, v_cache):
        b, t, _ = h.shape
        q, k, v = (z.reshape(b, t, HEADS, HEAD_DIM).transpose(1, 2)
                   for z in self.qkv(self.norm1(h)).chunk(3, -1))
        if k_cache is not None:       # every cached frame and the whole chunk are attended
            k = torch.cat([k_cache, k], 2) if self.order == APPEND else torch.cat([k, k_cache], 2)
            v = torch.cat([v_cache, v], 2) if self.order == APPEND else torch.cat([v, v_cache], 2)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, t, D_MODEL)), k, v

    def forward(self, h, k_cache, v_cache, conv_cache):
        a, k, v = self._attend(h, k_cache, v_cache)
        h = h + a
        c = h.transpose(1, 2)
        if conv_cache is None:
            conv_cache = c.new_zeros(c.shape[0], D_MODEL, 2)
        ctx = torch.cat([conv_cache, c], 2)
        h = h + self.conv(ctx).transpose(1, 2)
        h = h + self.ffn(self.norm2(h))
        return h, _cut(self.order, k), _cut(self.order, v), ctx[:, :, -2:]


class PromptDecoder(nn.Module):
    def __init__(self, order: str = APPEND, seed: int = 0):
        super().__init__()
        self.order = order
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.layers = nn.ModuleList(_Layer(order) for _ in range(LAYERS))
        self.cond = nn.Linear(HIST, D_MODEL)
        self.to_hist, self.to_mel = nn.Linear(D_MODEL, HIST), nn.Linear(D_MODEL, BINS)
        seed_weights(self, seed)

    def forward(self, tokens: torch.Tensor, state: Optional[State] = None):
        h = self.embed(tokens)
        if state is not None:         # the prosody history, read before anything is cut
            h = h + self.cond(state["hist"].mean(2)).unsqueeze(1)
        new = {}
        for i, layer in enumerate(self.layers):
            cached = [state[f"{kind}{i}"] if state is not None else None for kind in "kv"]
            conv = state[f"conv{i}"] if state is not None else None
            h, new[f"k{i}"], new[f"v{i}"], new[f"conv{i}"] = layer(h, *cached, conv)
        new["hist"] = self.history(h, state)
        return self.to_mel(h), new

    def history(self, h: torch.Tensor, state: Optional[State]) -> torch.Tensor:
        """The prosody history: this call's frames joined to the state's."""
        # contiguous: the next call's mean over frames gives other bits on a transposed state
        hist = self.to_hist(h).transpose(1, 2).contiguous()
        return _join(self.order, state["hist"] if state is not None else None, hist)


def prompt_adapter(order: str = APPEND) -> Adapter:
    kv = [Region(name=f"{kind}{i}", input=f"state.{kind}{i}", output=f"1.{kind}{i}", dim=2,
                 retention=PromptRetained("prompt", "retained"), advance="chunk", ordering=order,
                 shape=(1, "heads", None, "head_dim"), room="chunk")   # attention reads the join
          for i in range(LAYERS) for kind in "kv"]
    conv = [Region(name=f"conv{i}", input=f"state.conv{i}", output=f"1.conv{i}", dim=2,
                   retention=SlidingWindow("context", start="context"), advance="chunk",
                   ordering=APPEND, shape=(1, "d_model", None)) for i in range(LAYERS)]
    hist = Region(name="hist", input="state.hist", output="1.hist", dim=2,
                  retention=PromptRetained("prompt", "retained"), advance="chunk", ordering=order,
                  shape=(1, "hist", None))                             # only its cut reads it
    return Adapter(
        name=f"prompt-decoder-{order}",
        clocks={"prompt": PROMPT, "retained": RETAINED, "chunk": CHUNK, "context": 2,
                "heads": HEADS, "head_dim": HEAD_DIM, "d_model": D_MODEL, "hist": HIST},
        regions=(*kv, *conv, hist), call_frames=("chunk",), call_input="tokens", call_dim=1,
        admission="chunk", description="speaker-prompted decoder, caches cut to prompt + history")


def make_decoder(order: str = APPEND, device="cpu") -> PromptDecoder:
    return PromptDecoder(order).to(device).eval()


def serve(step, device="cpu", seed: int = 3) -> List[tuple]:
    """Two speakers, each primed with its own prompt; the first speaks two turns (the second
    from the primed state again: a turn reset), each turn ends on a partial chunk. Returns every
    call's output and state, cloned."""
    g = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(0, VOCAB, (1, n), generator=g).to(device)  # noqa: E731
    calls = []
    for turns in ((9, 4), (8,)):                      # chunks per turn, per speaker
        with torch.no_grad():
            _, primed = step(tokens(PROMPT), None)
            primed = {k: v.clone() for k, v in primed.items()}
            for chunks in turns:
                state = {k: v.clone() for k, v in primed.items()}
                for width in [CHUNK] * chunks + [FLUSH]:
                    y, state = step(tokens(width), state)
                    calls.append((y.clone(), {k: v.clone() for k, v in state.items()}))
    return calls


def served(device, cache_dir=None, full=None):
    """The decoder as ``cadence_fx.serve`` serves it (``build("streaming_prompt_decoder:served")``):
    a session opens primed with its speaker's prompt (``{"tokens": (1, PROMPT) int64}``, or a
    default speaker's), and each chunk sends ``{"tokens": (1, frames) int64}`` and gets
    ``{"mel": (1, frames, BINS)}`` back; a turn ends on a partial chunk (``FLUSH`` frames)."""
    import cadence_fx
    from cadence_fx.serve.models import ServedModel, need
    model = make_decoder(APPEND, device)
    default = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(11))

    def start(prompt):   # the speaker's priming pass: the stock step on the prompt, no state yet
        tokens = need(prompt, "tokens", (1, PROMPT)) if prompt else default
        with torch.no_grad():
            _, state = model(tokens.to(device), None)
        return {"step": {k: v.clone() for k, v in state.items()}}

    def chunk(run, inputs, last):
        return {"mel": run("step", need(inputs, "tokens", (1, None)).to(device))[0]}

    def example(seed, i):   # eight chunks fill the caches to prompt + history; the ninth flushes
        g = torch.Generator().manual_seed(1000 * seed + i)
        return {"tokens": torch.randint(0, VOCAB, (1, FLUSH if i == 8 else CHUNK), generator=g)}

    compiled = cadence_fx.compile(model, prompt_adapter(APPEND), cache_dir=cache_dir)
    return ServedModel("prompt-decoder", {"step": model}, {"step": compiled}, start, chunk,
                       example, deadline_ms=80.0, warm_chunks=9,
                       config={"layers": LAYERS, "prompt": PROMPT, "retained": RETAINED})
