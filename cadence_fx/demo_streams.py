"""The demo's streams, one per model: ``BUILDERS[model](device, chunks, full=...)`` builds the real
model and returns a ``_Stream`` whose ``stock(tick)`` and ``compiled(tick)`` run the stream once
(``demo.run_demo`` times and compares them). ``full`` picks the model's real configuration where
it has a smaller one for the CPU (Token2Wav, Moshi); ``None`` means full on CUDA, small on the
CPU. Also the comparisons the benchmarks share: ``same_state`` and ``_clone``."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, Optional

import torch

__all__ = ["BUILDERS", "same_state"]


@dataclasses.dataclass
class _Stream:
    """A model's stream: ``stock(tick)``/``compiled(tick)`` run it once and return one output
    per chunk (tensors or None, nested in tuples/dicts); ``tick(i)`` is called around chunk i."""
    stock: Callable
    compiled: Callable
    steps: Dict[str, object]               # name -> CompiledStep
    config: Dict
    chunks: int
    priming: Optional[Dict] = None         # eager-by-construction passes, counted
    extra: Dict = dataclasses.field(default_factory=dict)
    prepare_compiled: Optional[Callable] = None  # between the stock and compiled runs
    equal: Optional[Callable] = None       # chunk output comparison (default: ``_same``)
    audit: Optional[object] = None         # a CompiledStep with the shadow auditor on


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    return x


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def same_state(a, b) -> bool:
    """``(output, state)`` pairs equal bit for bit. Stock state may keep rows the declaration
    leaves out (an over-reserved envelope): the extra rows of the larger side must be zero, the
    rest equal."""
    (ya, sa), (yb, sb) = a, b
    if not _same(ya, yb) or sa.keys() != sb.keys():
        return False
    for k in sa:
        x, y = sa[k], sb[k]
        if x.shape != y.shape:
            big, small = (x, y) if x.numel() > y.numel() else (y, x)
            cut = tuple(slice(0, n) for n in small.shape)
            if not torch.equal(big[cut], small) or big.count_nonzero() != big[cut].count_nonzero():
                return False
        elif not torch.equal(x, y):
            return False
    return True


# -- models ------------------------------------------------------------------------------------

def _full(dev, full: Optional[bool]) -> bool:
    return dev.type == "cuda" if full is None else full


# Token2Wav's sizes: the real one, and the CPU default -- the same classes and state layout (the
# stock buffers keep 16 DiT slots at any depth), with one encoder block on each side of the
# upsampling and two DiT blocks, so a first run on a laptop-class CPU takes under a minute.
TOKEN2WAV_FULL = {"dit_depth": 16, "encoder_blocks": (6, 4)}
TOKEN2WAV_SMALL = {"dit_depth": 2, "encoder_blocks": (1, 1)}


def _describe(size) -> str:
    return "DiT depth {}, conformer encoder {} + {} blocks".format(size["dit_depth"],
                                                                 *size["encoder_blocks"])


def _token2wav(dev, chunks, full: Optional[bool] = None) -> _Stream:
    import cadence_fx
    from cadence_fx import adapters
    from .models.token2wav import FlowStep, HiFTStep, build_flow, build_hift, empty_hift_cache, prime_flow
    full = _full(dev, full)
    size = TOKEN2WAV_FULL if full else TOKEN2WAV_SMALL
    depth, blocks = size["dit_depth"], size["encoder_blocks"]
    flow = FlowStep(build_flow(depth, blocks=blocks, device=dev))
    hift = HiFTStep(build_hift(device=dev))
    spk, prompt = prime_flow(flow, device=dev)   # setup_cache: eager by construction
    turn = chunks // 2
    last = ([False] * (turn - 1) + [True]) + ([False] * (chunks - turn - 1) + [True])
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, 6561, (1, 28), generator=g).to(dev) for _ in last]
    autocast = (lambda: torch.autocast("cuda", dtype=torch.float32)) if dev.type == "cuda" \
        else contextlib.nullcontext

    def run(f, h, tick):
        if dev.type == "cuda":
            torch.cuda.manual_seed(1234)   # HiFT draws device randomness: same start both sides
        torch.manual_seed(1234)
        outs, state, cache = [], prompt, None
        for i, tok in enumerate(tokens):
            if i % turn == 0 and i // turn < 2:
                state, cache = prompt, empty_hift_cache(dev)   # turn boundary
            tick(i)
            with torch.inference_mode():
                with autocast():
                    mel, state = f(tok, spk, state, last_chunk=last[i])
                pcm, cache = h(mel, cache, last_chunk=last[i])
            tick(i)
            outs.append(_clone((mel, pcm)))
        return outs

    adapter = adapters.get("minicpmo-token2wav-flow").with_clocks(conformer_layers=sum(blocks))
    cflow = cadence_fx.compile(flow, adapter)
    chift = cadence_fx.compile(hift, "minicpmo-token2wav-hift")
    resident = sum(b.numel() * b.element_size() for m in (flow, hift) for b in m.buffers())
    return _Stream(
        stock=lambda tick: run(flow, hift, tick), compiled=lambda tick: run(cflow, chift, tick),
        steps={"flow": cflow, "hift": chift}, chunks=len(tokens),
        config={"size": "full" if full else "small", "dit_depth": depth,
                "encoder_blocks": list(blocks), "n_timesteps": 10, "prompt_frames": 302,
                "chunk_tokens": 28, "turns": 2, "deterministic_kernels": dev.type == "cuda",
                **({} if full else {"full_size": _describe(TOKEN2WAV_FULL)})},
        priming={"setup_cache": {"calls": 1, "eager": 1,
                                 "why": "cache-free prompt priming: no region state yet"}},
        extra={"resident_stock": resident})


def _moshi(dev, chunks, full: Optional[bool] = None) -> _Stream:
    import cadence_fx
    from .models import moshi as M
    small = not _full(dev, full)
    mimi = M.build_mimi(device=dev)
    lm_gen = M.build_lm_gen(device=dev, seed=1, overrides=M.SMALL_LM if small else None,
                            dtype=torch.float32 if small else torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    frames = [(0.1 * torch.randn(1, 1, 1920, generator=g)).to(dev) for _ in range(chunks)]
    reset_at = chunks // 2
    holder = {}

    def seed():
        torch.manual_seed(5)
        if dev.type == "cuda":
            torch.cuda.manual_seed(5)

    def stock(tick):
        seed()
        return M.stock_stream(mimi, lm_gen, frames, reset_at, on_frame=tick)

    def compiled(tick):
        seed()
        step, cs = holder["step"], holder["compiled"]
        # a later pass starts its stream in the last one's state, reset in place (the carries)
        last = holder.get("state")
        outs, state = [], step.initial_state() if last is None else step.reset_state(last)
        for i, frame in enumerate(frames):
            if i == reset_at:   # in place, as the stock loop's reset_streaming
                state = step.reset_state(state)
            tick(i)
            with torch.no_grad():
                pcm, tokens, state = cs(frame, state)
            tick(i)
            outs.append(_clone((pcm, tokens)))
        holder["state"] = state
        return outs

    def prepare():  # the step keeps the modules streaming: built after the stock runs
        step = M.MoshiStep(mimi, lm_gen)
        adapter = M.moshi_adapter(M.SMALL_LM if small else None)
        holder["step"], holder["compiled"] = step, cadence_fx.compile(step, adapter)
        stream.steps["frame"] = holder["compiled"]

    stream = _Stream(stock=stock, compiled=compiled, steps={}, chunks=len(frames),
                     config={"size": "small" if small else "full",
                             "lm": "2-layer LM (SMALL_LM), fp32" if small else "7B LM (32 layers, 4096), bf16",
                             "mimi": "real (SEANet + 8+8 transformer layers, 8 codebooks), fp32",
                             "frame_samples": 1920, "turns": 2,
                             **({"full_size": "7B LM (32 layers, 4096), bf16"} if small else {})},
                     prepare_compiled=prepare)
    return stream


def _freeze_omni(dev, chunks, full: Optional[bool] = None) -> _Stream:   # one size
    import cadence_fx
    from .models.freeze_omni import REAL_CONFIG, FreezeOmniEncoder
    enc = FreezeOmniEncoder(**REAL_CONFIG).to(dev).eval()
    g = torch.Generator().manual_seed(1)
    feats = [torch.randn(1, 16, 80, generator=g).to(dev) for _ in range(chunks)]
    reset_at = chunks // 2

    def run(step, tick):
        outs, state = [], enc.initial_state()
        for i, f in enumerate(feats):
            if i == reset_at:
                state = enc.initial_state()
            tick(i)
            with torch.inference_mode():
                y, state = step(f, state)
            tick(i)
            outs.append(_clone((y, state)))
        return outs

    compiled = cadence_fx.compile(enc, "freeze-omni")
    return _Stream(stock=lambda tick: run(enc, tick), compiled=lambda tick: run(compiled, tick),
                   steps={"encoder": compiled}, chunks=len(feats),
                   config={"size": "full", **REAL_CONFIG, "turns": 2})


def _toy(dev, chunks, full: Optional[bool] = None) -> _Stream:   # one size
    import cadence_fx
    from .models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
    model = PromptRetainedToy(dim=256, heads=4, layers=4).to(dev)
    adapter = PROMPT_RETAINED_ADAPTER.with_clocks(layers=4, kv_width=2 * 256 // 4)
    c = adapter.clocks
    g = torch.Generator().manual_seed(7)
    prompt = torch.randn(1, c["f_prompt"], 256, generator=g).to(dev)
    with torch.no_grad():
        _, state = model(prompt, None)
    prompt_state = {k: v.clone() for k, v in state.items()}
    half = chunks // 2   # steady chunks, a partial flush ending the first turn, a longer last call
    widths = ([c["f_chunk"]] * (half - 1) + [c["f_chunk"] // 2]
              + [c["f_chunk"]] * (chunks - half - 1) + [c["f_call"]])
    xs = [torch.randn(1, w, 256, generator=g).to(dev) for w in widths]
    addresses: Dict[str, set] = {"stock": set(), "compiled": set(), "audit": set()}

    def run(step, tick, key):
        outs, state = [], prompt_state
        for i, x in enumerate(xs):
            if i == half:
                state = prompt_state   # turn boundary: restore the prompt state
            tick(i)
            with torch.inference_mode():
                y, state = step(x, state)
            tick(i)
            addresses[key].update(v.data_ptr() for v in state.values())
            outs.append(_clone((y, state)))
        return outs

    compiled = cadence_fx.compile(model, adapter)
    stream = _Stream(stock=lambda tick: run(model, tick, "stock"),
                     compiled=lambda tick: run(compiled, tick, "compiled"),
                     steps={"step": compiled}, chunks=len(xs),
                     config={"size": "full", "dim": 256, "heads": 4, "layers": 4,
                             "widths": widths},
                     priming={"prompt": {"calls": 1, "eager": 1, "why": "no state yet"}})
    stream.extra["addresses"] = addresses
    stream.extra["resident_stock"] = sum(b.numel() * b.element_size() for b in model.buffers())
    stream.audit = cadence_fx.compile(model, adapter, verify=True)
    stream.extra["audit_run"] = lambda tick: run(stream.audit, tick, "audit")
    stream.equal = same_state
    return stream


BUILDERS = {"token2wav": _token2wav, "moshi": _moshi, "freeze-omni": _freeze_omni, "toy": _toy}
