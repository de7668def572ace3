"""The demo: one stream through the stock path and through cadence_fx, compared bit for bit.

Models (``--model``):

* ``token2wav`` (default): the real MiniCPM-o 4.5 / Step-Audio2 Token2Wav at its real
  configuration (conformer encoder 6 + 4 blocks, DiT depth 16, 10 Euler steps, HiFT), random
  weights. The prompt-priming pass (``setup_cache``, 302 frames) runs eager by construction and is
  counted; then two turns of 28-token chunks, each turn restoring the prompt state and ending with
  a last (flush) chunk. Each chunk is the flow step then the HiFT step, each compiled on its own.
  On CUDA, deterministic kernels are pinned on both sides (stock HiFT is not reproducible
  without them).
* ``moshi``: Mimi encode + ``LMGen`` step + Mimi decode per 1920-sample frame (the loop of
  ``moshi/server.py``); the 7B LM on CUDA, a 2-layer LM of the same code on the CPU (``config``
  says which). A turn boundary calls the stock ``reset_streaming``; the compiled step restarts
  from a fresh state.
* ``freeze-omni``: the streaming conv + chunked-attention encoder (24 x 1024), 16 fbank frames
  per call, a turn reset in the middle.
* ``toy``: a prompt-retained attention toy with a partial flush and a longer last call.

Each path runs the stream once to warm up (the compiled path traces and captures its classes
then), then ``TIMED_PASSES`` times timed per chunk -- CUDA events on a GPU, ``perf_counter`` on
the CPU; the result has each pass's p50 and the spread between them. On the CPU the compiled path
is the rewritten graph on the guarded eager path (about stock speed); on CUDA it replays CUDA
graphs. Every key of the result is described in docs/benchmarks.md ("The demo's JSON").
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Callable, Dict, Optional

import torch

from . import progress

__all__ = ["run_demo", "MODELS"]

MODELS = ("token2wav", "moshi", "freeze-omni", "toy")


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


class _Clock:
    """Per-chunk latency: ``tick(i)`` before and after chunk i."""

    def __init__(self, dev: torch.device):
        self.dev, self.times, self._open = dev, [], None

    def __call__(self, i: int) -> None:
        if self._open is None:
            if self.dev.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                self._open = start
            else:
                self._open = time.perf_counter()
            return
        if self.dev.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize()
            self.times.append(self._open.elapsed_time(end))
        else:
            self.times.append((time.perf_counter() - self._open) * 1e3)
        self._open = None


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


def _p95(xs) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


# -- models ------------------------------------------------------------------------------------

def _token2wav(dev, chunks) -> _Stream:
    import cadence_fx
    from .models.token2wav import FlowStep, HiFTStep, build_flow, build_hift, empty_hift_cache, prime_flow
    depth, blocks = 16, (6, 4)
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

    cflow = cadence_fx.compile(flow, "minicpmo-token2wav-flow")
    chift = cadence_fx.compile(hift, "minicpmo-token2wav-hift")
    resident = sum(b.numel() * b.element_size() for m in (flow, hift) for b in m.buffers())
    return _Stream(
        stock=lambda tick: run(flow, hift, tick), compiled=lambda tick: run(cflow, chift, tick),
        steps={"flow": cflow, "hift": chift}, chunks=len(tokens),
        config={"dit_depth": depth, "encoder_blocks": list(blocks), "n_timesteps": 10,
                "prompt_frames": 302, "chunk_tokens": 28, "turns": 2,
                "deterministic_kernels": dev.type == "cuda"},
        priming={"setup_cache": {"calls": 1, "eager": 1,
                                 "why": "cache-free prompt priming: no region state yet"}},
        extra={"resident_stock": resident})


def _moshi(dev, chunks) -> _Stream:
    import cadence_fx
    from .models import moshi as M
    small = dev.type != "cuda"
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
                     config={"lm": "2-layer LM (SMALL_LM), fp32" if small else "7B LM (32 layers, 4096), bf16",
                             "mimi": "real (SEANet + 8+8 transformer layers, 8 codebooks), fp32",
                             "frame_samples": 1920, "turns": 2},
                     prepare_compiled=prepare)
    return stream


def _freeze_omni(dev, chunks) -> _Stream:
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
                   config=dict(REAL_CONFIG, turns=2))


def _toy(dev, chunks) -> _Stream:
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
                     config={"dim": 256, "heads": 4, "layers": 4, "widths": widths},
                     priming={"prompt": {"calls": 1, "eager": 1, "why": "no state yet"}})
    stream.extra["addresses"] = addresses
    stream.extra["resident_stock"] = sum(b.numel() * b.element_size() for b in model.buffers())
    stream.audit = cadence_fx.compile(model, adapter, verify=True)
    stream.extra["audit_run"] = lambda tick: run(stream.audit, tick, "audit")
    stream.equal = same_state
    return stream


_BUILDERS = {"token2wav": _token2wav, "moshi": _moshi, "freeze-omni": _freeze_omni, "toy": _toy}


# -- the run ------------------------------------------------------------------------------------

TIMED_PASSES = 2   # per path; a single pass's p50 swings with the machine's load


def _passes(fn, dev, runs):
    """``runs`` passes of a stream: their results, each pass's per-chunk times, and the
    allocator peak (CUDA) over the last one."""
    results, times = [], []
    for i in range(runs):
        if dev.type == "cuda" and i == runs - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        clock = _Clock(dev)
        results.append(fn(clock))
        times.append(clock.times)
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
    return results, times, peak


def run_demo(model: str = "token2wav", device: str = "cpu", chunks: Optional[int] = None,
             verify: bool = True) -> Dict:
    if model not in _BUILDERS:
        raise ValueError(f"unknown demo model {model!r}; choose from {', '.join(MODELS)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    if chunks is None:
        chunks = 16 if model == "toy" or dev.type == "cuda" else 4
    if chunks < 4:
        raise ValueError("a demo stream needs at least 4 chunks (two turns of two)")
    if model == "token2wav" and dev.type == "cuda":
        from .determinism import pin_deterministic_kernels
        pin_deterministic_kernels()
    progress.note("demo %s on %s: building the model ...", model, dev.type, running=True)
    stream = _BUILDERS[model](dev, chunks)
    progress.note("demo %s: stock stream, %d passes of %d chunks ...", model, 1 + TIMED_PASSES,
                  stream.chunks, running=True)
    stock_runs, stock_times, stock_peak = _passes(stream.stock, dev, 1 + TIMED_PASSES)
    stock_times = stock_times[1:]                            # the first pass warms up
    progress.note("demo %s: stock p50 %.1f ms per chunk", model,
                  statistics.median(sum(stock_times, [])))
    if stream.prepare_compiled is not None:
        stream.prepare_compiled()
    first = stream.compiled(_Clock(dev))                     # traces and captures here
    progress.note("demo %s: compiled, timing and comparing ...", model, running=True)
    warm = {n: (s.counters.replays, s.counters.fallbacks) for n, s in stream.steps.items()}
    timed, times, compiled_peak = _passes(stream.compiled, dev, TIMED_PASSES)
    ref = stock_runs[-1]
    runs = [first, *timed]
    equal = stream.equal or _same
    if verify and stream.audit is not None:  # the shadow auditor on every carry write (syncs)
        progress.note("demo %s: the shadow audit pass (every carry write checked) ...", model,
                      running=True)
        runs.append(stream.extra["audit_run"](lambda i: None))
    bit_exact = all(len(r) == len(ref) and all(map(equal, ref, r)) for r in runs)
    steps = {}
    for name, s in stream.steps.items():
        c = s.counters
        steps[name] = {"calls": c.calls, "replays": c.replays, "fallbacks": c.fallbacks,
                       "steady_replays": c.replays - warm[name][0],
                       "steady_fallbacks": c.fallbacks - warm[name][1],
                       "classes": len(s.classes), "traces": c.traces,
                       "eager_pieces": c.eager_pieces, "guarded_eager": c.guarded_eager,
                       "memory": s.report().memory()}
    total = lambda key: sum(getattr(s.counters, key) for s in stream.steps.values())  # noqa: E731
    # stock pass i against compiled pass i: how far one pass's figure can be trusted
    ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(stock_times, times)]
    result = {
        "model": model, "device": str(dev), "chunks": stream.chunks, "config": stream.config,
        "bit_exact": bit_exact,
        "bit_exact_chunks": sum(equal(a, b) for a, b in zip(ref, timed[-1])),
        "carry_addresses": max(s.counters.carry_addresses for s in stream.steps.values()),
        "retentions": total("retentions"),
        "replays": total("replays"), "fallbacks": total("fallbacks"),
        "steady_replays": sum(s["steady_replays"] for s in steps.values()),
        "steady_fallbacks": sum(s["steady_fallbacks"] for s in steps.values()),
        "invalidations": total("invalidations"), "traces": total("traces"),
        "per_invocation": dict(stream.priming or {}, **steps),
        "timed_passes": TIMED_PASSES,
        "stock_ms_p50": statistics.median(sum(stock_times, [])),
        "compiled_ms_p50": statistics.median(sum(times, [])),
        "stock_ms_p95": _p95(sum(stock_times, [])), "compiled_ms_p95": _p95(sum(times, [])),
        "speedup_p50": statistics.median(sum(stock_times, [])) / statistics.median(sum(times, [])),
        "stock_ms_p50_per_pass": [statistics.median(t) for t in stock_times],
        "compiled_ms_p50_per_pass": [statistics.median(t) for t in times],
        "speedup_p50_spread": [min(ratios), max(ratios)],
        "fallback_reasons": {k: v for s in stream.steps.values() for k, v in s.counters.reasons.items()},
    }
    if dev.type == "cuda":
        # the allocator's peak during the timed pass of each path (weights included)
        result.update(stock_peak_bytes=stock_peak, compiled_peak_bytes=compiled_peak,
                      peak_bytes_kind="max_memory_allocated")
    else:
        result["note"] = ("on the CPU the compiled path runs its rewritten graphs eagerly (no "
                          "device graphs): expect about stock speed; the speedup is a GPU figure")
        # torch reports no CPU allocator peak: the bytes of state each path keeps resident
        carries = sum(c.tensor.numel() * c.tensor.element_size()
                      for s in stream.steps.values() for c in s.carries.values())
        result.update(stock_peak_bytes=stream.extra.get("resident_stock"),
                      compiled_peak_bytes=carries, peak_bytes_kind="resident_state")
    if "addresses" in stream.extra:
        result["stock_state_addresses"] = len(stream.extra["addresses"]["stock"])
    if verify and stream.audit is not None:
        result["audited_writes"] = sum(stream.audit.auditor.comparisons.values())
    return result
