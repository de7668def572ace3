"""A chunked streaming conformer encoder, its adapter, and helpers that run it as a server does.

The model is a test vehicle of our own (none of the supported families), written the way most
streaming speech code keeps its caches:

- the input features are dithered with device randomness (``feats + 1e-3 * randn_like(feats)``);
- each layer is macaron FFN -> RoPE self-attention -> causal depthwise conv -> FFN -> norm;
- attention keeps a per-layer K/V cache as ``cat([k_cache, k_new], 2)[:, :, -W:]``: keys are
  rotated at their absolute positions (``offset + arange(t)``) before they are cached, new frames
  attend to every cached frame and causally within the chunk;
- the conv module keeps its left context as ``ctx = cat([conv_cache, h], 2)`` and the new conv
  cache is ``ctx[:, :, -4:]`` (kernel 5).

``StreamingConformer.forward(feats, state) -> (out, new_state)``: ``feats`` is (batch, frames,
80), ``state`` a dict of per-layer tensors ``k{i}``, ``v{i}`` (batch, heads, frames, head_dim),
``conv{i}`` (batch, d_model, 4) and an int64 ``offset`` (1,), or None for the priming pass:
``forward(prompt_feats, None)`` runs a speaker's 16-frame prompt without caches and returns the
state a turn starts from (K/V extent min(prompt, W) = 16, a zero-padded conv context).
Steady chunks are 8 or 12 frames; a turn may end on a 4-frame flush.

``StreamingConformer(stacked=True)`` keeps the same caches the way Freeze-Omni and WeNet-style
encoders do: each layer still cuts its own window, and the per-layer windows are joined into one
tensor per kind (``k``, ``v``: (layers, batch, heads, frames, head_dim); ``conv``: (layers,
batch, d_model, 4)); ``STACKED_ADAPTER`` declares them.
"""
from __future__ import annotations

import random
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cadence_fx.contract import APPEND, Adapter, Effects, Region, SlidingWindow
from cadence_fx.passes.fx_utils import is_mutating, mutated_arg, view_chain

__all__ = ["one_thread", "StreamingConformer", "CONFORMER_ADAPTER", "STACKED_ADAPTER", "CLOCKS", "LAYERS", "BINS", "PROMPT",
           "CHUNKS", "FLUSH", "make_model", "prompt_feats", "chunk_feats", "clone_state",
           "prime", "run_turns", "interleave", "run_alone", "serve_scripts", "assert_calls_equal",
           "assert_sessions_equal", "joins_feeding_carries", "served", "State"]

LAYERS, D_MODEL, HEADS, FFN, BINS, KERNEL = 3, 64, 4, 256, 80, 5
PROMPT, WINDOW, CHUNKS, FLUSH = 16, 24, (8, 12), 4

State = Dict[str, torch.Tensor]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Intra-op parallelism pinned to one thread while a test file that imports this runs (both
    sides run under it): on a shared 2-core machine two OpenMP threads per op make each chunk
    some 50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half form; ``cos``/``sin`` are (frames, head_dim)."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


class RopeAttention(nn.Module):
    def __init__(self, dim: int, heads: int, window: int):
        super().__init__()
        self.heads, self.head_dim, self.window = heads, dim // heads, window
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x, k_cache: Optional[torch.Tensor], v_cache: Optional[torch.Tensor],
                offset: torch.Tensor):
        b, t, _ = x.shape
        q, k, v = (z.reshape(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, dim=-1))
        pos = (offset + torch.arange(t, device=x.device)).to(x.dtype)
        angles = pos[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if k_cache is not None:
            k = torch.cat([k_cache, k], dim=2)
            v = torch.cat([v_cache, v], dim=2)
        held = k.shape[2] - t
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        mask = torch.cat([torch.ones(t, held, dtype=torch.bool, device=x.device), causal], dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        o = self.out(o.transpose(1, 2).reshape(b, t, -1))
        return o, k[:, :, -self.window:], v[:, :, -self.window:]


class CausalConvModule(nn.Module):
    """Pointwise conv + GLU, a causal depthwise conv over the cached left context, norm, SiLU,
    pointwise conv."""

    def __init__(self, dim: int, kernel: int):
        super().__init__()
        self.context = kernel - 1
        self.pw1 = nn.Conv1d(dim, 2 * dim, 1)
        self.dw = nn.Conv1d(dim, dim, kernel, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pw2 = nn.Conv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor, conv_cache: Optional[torch.Tensor]):
        h = F.glu(self.pw1(x.transpose(1, 2)), dim=1)            # (batch, dim, frames)
        if conv_cache is None:                                    # priming: zero left context
            conv_cache = h.new_zeros(h.shape[0], h.shape[1], self.context)
        ctx = torch.cat([conv_cache, h], 2)
        h = self.dw(ctx)
        h = F.silu(self.norm(h.transpose(1, 2))).transpose(1, 2)
        return self.pw2(h).transpose(1, 2), ctx[:, :, -self.context:]


class ConformerLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int, kernel: int, window: int):
        super().__init__()
        self.ff1, self.ff2 = (
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, ffn), nn.SiLU(), nn.Linear(ffn, dim))
            for _ in range(2))
        self.norm_att, self.norm_conv, self.norm_out = (nn.LayerNorm(dim) for _ in range(3))
        self.att = RopeAttention(dim, heads, window)
        self.conv = CausalConvModule(dim, kernel)

    def forward(self, x, k_cache, v_cache, conv_cache, offset):
        x = x + 0.5 * self.ff1(x)
        y, k, v = self.att(self.norm_att(x), k_cache, v_cache, offset)
        x = x + y
        y, conv = self.conv(self.norm_conv(x), conv_cache)
        x = x + y
        x = x + 0.5 * self.ff2(x)
        return self.norm_out(x), k, v, conv


class StreamingConformer(nn.Module):
    def __init__(self, layers: int = LAYERS, dim: int = D_MODEL, heads: int = HEADS, ffn: int = FFN,
                 bins: int = BINS, kernel: int = KERNEL, window: int = WINDOW, seed: int = 0,
                 stacked: bool = False):
        super().__init__()
        self.stacked = stacked
        self.embed = nn.Linear(bins, dim)
        self.layers = nn.ModuleList(ConformerLayer(dim, heads, ffn, kernel, window)
                                    for _ in range(layers))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # every parameter random, norms and biases included
            for name, p in self.named_parameters():
                r = torch.randn(p.shape, generator=g)
                p.copy_(r / max(1, p[0].numel()) ** 0.5 if p.dim() > 1
                        else (0.05 * r if name.endswith("bias") else 1 + 0.1 * r))

    def forward(self, feats: torch.Tensor, state: Optional[State] = None):
        x = feats + 1e-3 * torch.randn_like(feats)                # dither: device randomness
        if state is None:
            offset = torch.zeros(1, dtype=torch.long, device=feats.device)
        else:
            offset = state["offset"]
        x = self.embed(x)
        new: State = {}
        for i, layer in enumerate(self.layers):
            if state is None:
                cached = (None, None, None)
            elif self.stacked:
                cached = (state["k"][i], state["v"][i], state["conv"][i])
            else:
                cached = (state[f"k{i}"], state[f"v{i}"], state[f"conv{i}"])
            x, new[f"k{i}"], new[f"v{i}"], new[f"conv{i}"] = layer(x, *cached, offset)
        if self.stacked:   # the per-layer windows joined into one tensor per kind
            new = {kind: torch.stack([new.pop(f"{kind}{i}") for i in range(len(self.layers))])
                   for kind in ("k", "v", "conv")}
        new["offset"] = offset + feats.shape[1]
        return x, new


# -- the adapter ------------------------------------------------------------------------------

CLOCKS = {"prompt": PROMPT, "window": WINDOW, "chunk": CHUNKS[0], "chunk_long": CHUNKS[1],
          "conv_context": KERNEL - 1, "batch": 1, "heads": HEADS, "head_dim": D_MODEL // HEADS,
          "d_model": D_MODEL, "layers": LAYERS}


def _kv(name: str, stacked: bool = False) -> Region:
    # The window enters the first cached call at the prompt's extent (16) and is capped at W = 24.
    # Steady chunks advance it by 8 or 12; a Region has one advance clock, so the smallest is
    # declared (16 + 8 and 16 + 12 both cap at 24 here, so the extents are the same).
    layers = ("layers",) if stacked else ()
    return Region(name=name, input=f"state.{name}", output=f"1.{name}", dim=2 + len(layers),
                  retention=SlidingWindow("window", start="prompt"), advance="chunk",
                  room="chunk_long",   # the most frames one call appends before the window drops
                  ordering=APPEND, shape=layers + ("batch", "heads", None, "head_dim"))


def _conv(name: str, stacked: bool = False) -> Region:
    # Full-size left context from the priming pass on: one extent.
    layers = ("layers",) if stacked else ()
    return Region(name=name, input=f"state.{name}", output=f"1.{name}", dim=2 + len(layers),
                  retention=SlidingWindow("conv_context", start="conv_context"), advance="chunk",
                  room="chunk_long", ordering=APPEND, shape=layers + ("batch", "d_model", None))


CONFORMER_ADAPTER = Adapter(
    name="streaming-conformer",
    clocks=CLOCKS,
    regions=tuple(r for i in range(LAYERS)
                  for r in (_kv(f"k{i}"), _kv(f"v{i}"), _conv(f"conv{i}"))),
    call_frames=("chunk", "chunk_long"), call_input="feats", call_dim=1,
    admission="chunk",          # the flush: whatever is left, narrower than a chunk
    effects=Effects(device_rng=True),
    description="chunked streaming conformer: RoPE attention over a W-frame window, causal conv",
)

STACKED_ADAPTER = Adapter(
    name="streaming-conformer-stacked",
    clocks=CLOCKS,
    regions=(_kv("k", stacked=True), _kv("v", stacked=True), _conv("conv", stacked=True)),
    call_frames=("chunk", "chunk_long"), call_input="feats", call_dim=1,
    admission="chunk", effects=Effects(device_rng=True),
    description="the streaming conformer with its per-layer caches stacked into one tensor each",
)


# -- streams --------------------------------------------------------------------------------

def make_model(seed: int = 0, stacked: bool = False) -> StreamingConformer:
    return StreamingConformer(seed=seed, stacked=stacked).eval()


def prompt_feats(speaker: int) -> torch.Tensor:
    """The speaker's fixed 16-frame prompt."""
    return torch.randn(1, PROMPT, BINS, generator=torch.Generator().manual_seed(1000 + speaker))


def chunk_feats(widths: Sequence[int], seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, w, BINS, generator=g) for w in widths]


def clone_state(state: State) -> State:
    return {k: v.clone() for k, v in state.items()}


def prime(step, speaker: int) -> State:
    """The priming pass: the speaker's prompt without caches; returns the turn's starting state."""
    with torch.no_grad():
        return step(prompt_feats(speaker), None)[1]


def run_turns(step, turns: Sequence[Tuple[int, Sequence[int]]], seed: int):
    """Run ``turns`` -- (speaker, chunk widths), each re-primed from the speaker's prompt -- under
    ``torch.manual_seed(seed)``. Returns, per call (priming included), the output and the state it
    returned, cloned, and the generator state at the end."""
    torch.manual_seed(seed)
    calls = []
    for t, (speaker, widths) in enumerate(turns):
        with torch.no_grad():
            out, state = step(prompt_feats(speaker), None)
            calls.append((out.clone(), clone_state(state)))
            for x in chunk_feats(widths, seed=seed * 100 + t):
                out, state = step(x, state)
                calls.append((out.clone(), clone_state(state)))
    return calls, torch.get_rng_state()


def interleave(scripts: Sequence[Sequence], arrivals: Sequence[int], seed: int):
    """One interleaving of the sessions' scripts, as a server meets them: ``(session, op)`` per
    global step, where one of the sessions that have arrived (``arrivals[i]``: the step from
    which session ``i`` may start) and have ops left runs its next op."""
    rng, pos, order = random.Random(seed), [0] * len(scripts), []
    while any(p < len(s) for p, s in zip(pos, scripts)):
        ready = [i for i, (p, s) in enumerate(zip(pos, scripts))
                 if p < len(s) and arrivals[i] <= len(order)]
        i = rng.choice(ready) if ready else min(i for i, (p, s) in enumerate(zip(pos, scripts))
                                                if p < len(s))
        order.append((i, scripts[i][pos[i]]))
        pos[i] += 1
    return order


def run_alone(step, rng_seed: int, feats: Sequence[torch.Tensor], script: Sequence,
              start: Optional[State] = None, prompt: Optional[torch.Tensor] = None):
    """One session's ``script`` by itself on ``step``, its generator seeded ``rng_seed``, its own
    state from ``start``: an int is a call on that chunk of ``feats``, ``"prime"`` a call on
    ``prompt`` without state, ``"save"`` clones the state, ``"retry"`` goes back to it,
    ``"reset"`` back to ``start``, ``"close"`` ends it. Returns every call's output, cloned."""
    torch.manual_seed(rng_seed)
    outs, state, saved = [], start, None
    for op in script:
        if op == "save":
            saved = clone_state(state)
        elif op == "retry":
            state = saved
        elif op == "reset":
            state = start
        elif op != "close":
            x, state = (prompt, None) if op == "prime" else (feats[op], state)
            with torch.no_grad():
                out, state = step(x, state)
            outs.append(out.clone())
    return outs


def serve_scripts(pool, sessions: Sequence[Tuple], arrivals: Sequence[int], feats, seed: int,
                  start=lambda speaker: None, prompt=prompt_feats):
    """The sessions ``(speaker, generator seed, feature seed, script)`` served through ``pool``
    in one interleaving (``interleave(..., seed)``), each opened from ``start(speaker)`` with its
    generator seed at its first op; the ops as in ``run_alone``, ``"prime"`` resetting the session
    to no state and calling on ``prompt(speaker)``. Returns the outputs per session (cloned), the
    session ids and how often a session arrived, was primed or retired while others streamed."""
    ids, saved, outs = {}, {}, [[] for _ in sessions]
    seen = dict.fromkeys(("arrived", "primed", "retired"), 0)
    for i, op in interleave([script for *_, script in sessions], arrivals, seed=seed):
        speaker, rng_seed = sessions[i][:2]
        if i not in ids:
            seen["arrived"] += bool(pool.sessions)
            ids[i] = pool.open(start(speaker), seed=rng_seed)
        sid = ids[i]
        if op == "save":
            saved[i] = clone_state(pool.state(sid))   # region entries are views of the carries
        elif op == "retry":
            pool.reset(sid, saved[i])
        elif op == "reset":
            pool.reset(sid, start(speaker))
        elif op == "close":
            pool.close(sid)
            seen["retired"] += bool(pool.sessions)
        else:
            if op == "prime":
                seen["primed"] += len(pool.sessions) > 1
                pool.reset(sid, None)
            with torch.no_grad():
                out, _ = pool.step(sid, prompt(speaker) if op == "prime" else feats[i][op])
            outs[i].append(out.clone())
    return outs, ids, seen


def assert_calls_equal(got, want):
    """``(output, state)`` per call (``run_turns``) equal to stock's: every output and every
    state tensor, key by key, with ``torch.equal``."""
    assert len(got) == len(want)
    for i, ((out, state), (ref_out, ref_state)) in enumerate(zip(got, want)):
        assert torch.equal(out, ref_out), f"call {i}: output differs from stock"
        assert state.keys() == ref_state.keys(), f"call {i}"
        for k in ref_state:
            assert state[k].shape == ref_state[k].shape, f"call {i}: state {k!r} shape"
            assert torch.equal(state[k], ref_state[k]), f"call {i}: state {k!r} differs from stock"


def assert_sessions_equal(outs, alone, what: str = "call"):
    """Every session's outputs equal, call by call, those of the session run alone."""
    for i, (got, want) in enumerate(zip(outs, alone, strict=True)):
        assert len(got) == len(want) > 0, f"session {i}"
        for j, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"session {i} {what} {j} differs from the session run alone"


def joins_feeding_carries(entry, joins) -> List[Tuple[str, str]]:
    """``(carry, join node)`` for every in-place write into a carry of a compiled class whose
    source is (a view of) one of ``joins`` (e.g. ``aten.cat``): the stock join still runs to form
    the new state."""
    gm = entry.records.graph or entry.gm
    carries = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("carry_")}
    found = []
    for n in gm.graph.nodes:
        dst = mutated_arg(n) if is_mutating(n) else None
        if dst is None or view_chain(dst)[0] not in carries:
            continue
        for src in n.all_input_nodes:
            base = view_chain(src)[0]
            if src is not dst and base.op == "call_function" and base.target in joins:
                found.append((view_chain(dst)[0].name, base.name))
    return found


# -- served ----------------------------------------------------------------------------------

def served(device, cache_dir=None, full=None):
    """The conformer as ``cadence_fx.serve`` serves it (``build("streaming_conformer:served",
    device)``): a session opens primed with its speaker's prompt (``{"speaker": (1,) int64}``,
    speaker 0 by default; the priming pass dithers from a generator seeded by the speaker, so a
    speaker's start state is the same wherever it is primed, and leaves the process's generators
    as they were), and each chunk sends ``{"feats": (1, frames, BINS)}`` (8 or 12 frames, a 4-frame
    flush) and gets ``{"out": (1, frames, d_model)}`` back. Every chunk draws device randomness
    (the dither): a session opened with ``seed`` draws from a generator state of its own."""
    import cadence_fx
    from cadence_fx.serve.models import ServedModel, need
    model = make_model().to(device)

    def start(prompt):
        speaker = int(need(prompt, "speaker", (1,))[0]) if prompt else 0
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                torch.no_grad():
            torch.manual_seed(1000 + speaker)
            _, state = model(prompt_feats(speaker).to(device), None)
        return {"step": clone_state(state)}

    def chunk(run, inputs, last):
        return {"out": run("step", need(inputs, "feats", (1, None, BINS)).to(device))[0]}

    def example(seed, i):   # both chunk widths, then the flush
        return {"feats": chunk_feats([CHUNKS[i % 2] if i < 5 else FLUSH], seed=1000 * seed + i)[0]}

    compiled = cadence_fx.compile(model, CONFORMER_ADAPTER, cache_dir=cache_dir)
    return ServedModel("streaming-conformer", {"step": model}, {"step": compiled}, start, chunk,
                       example, deadline_ms=80.0, warm_chunks=6,
                       config={"layers": LAYERS, "window": WINDOW, "prompt": PROMPT})
