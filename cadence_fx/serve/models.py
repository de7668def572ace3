"""What a replica serves: a model's compiled steps, how a session starts and what one chunk runs.

A ``ServedModel`` holds the stock steps and their compiled steps (one ``SessionPool`` each, made
by the engine), the start state of each step for a new session (the priming: a speaker's prompt,
an empty cache), and ``chunk(run, inputs, last)``: one chunk of one session, where
``run(step, *args, **kwargs)`` runs a step for that session (its state held by the pool, or, for
``StockSession``, by the session itself). The same ``chunk`` runs the served path and the stock
reference, so what a test or a benchmark compares is the step, never two copies of the loop.

Models (``build(name, ...)``): ``toy`` (the demo's prompt-retained attention toy, 4 x 256),
``token2wav`` (MiniCPM-o 4.5 flow + HiFT; the demo's CPU size unless ``full``), ``freeze-omni``
(the 24 x 1024 streaming encoder) and ``moshi`` (Mimi + LM frame; a 2-layer LM unless ``full``);
or one's own, ``"package.module:factory"`` (docs/serving.md, Serving your own model).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Callable, Dict, List, Optional

import torch

from cadence_fx.cudagraphs import GLOBAL_STATE

__all__ = ["ServedModel", "StockSession", "build", "need", "MODELS"]

Tensors = Dict[str, torch.Tensor]


@dataclasses.dataclass
class ServedModel:
    name: str
    stock: Dict[str, Callable]                 # step name -> the stock step
    compiled: Dict[str, object]                # step name -> its CompiledStep
    start: Callable[[Tensors], Dict[str, object]]   # prompt tensors -> each step's start state
    chunk: Callable[[Callable, Tensors, bool], Tensors]
    example: Callable[[int, int], Tensors]     # (session seed, chunk index) -> a chunk's inputs
    deadline_ms: float                         # the audio one chunk carries
    warm_chunks: int = 4                       # a warm-up stream this long visits the catalog
    config: Dict = dataclasses.field(default_factory=dict)

    def warm_stream(self) -> List[Tensors]:
        return [self.example(0, i) for i in range(self.warm_chunks)]


class StockSession:
    """One session on the stock steps, alone: the reference a served session must equal bit for
    bit. Keeps each step's state (a copy: stock steps may hand out views of scratch buffers) and,
    with ``seed``, each randomness-drawing step's generator state, as a pool does."""

    def __init__(self, model: ServedModel, prompt: Optional[Tensors] = None,
                 seed: Optional[int] = None):
        from cadence_fx.sessions import SessionPool
        self.model, self.prompt = model, prompt or {}
        pools = {n: SessionPool(cs) for n, cs in model.compiled.items()}
        self.slots = {n: (p.state_arg, p.state_out) for n, p in pools.items()}
        with GLOBAL_STATE.exclusive():   # the generators, as the steps' own
            self.rng = {n: _seeded(cs, seed) for n, cs in model.compiled.items()
                        if seed is not None and cs.adapter.effects.device_rng}
        self.reset()

    # the stock steps are the compiled steps' modules and write their buffers: they run alone in
    # the process (``cudagraphs.GLOBAL_STATE``), e.g. beside a served session in another thread
    def reset(self) -> None:
        with GLOBAL_STATE.exclusive():
            self.states = self.model.start(self.prompt)

    def chunk(self, inputs: Tensors, last: bool = False) -> Tensors:
        with torch.inference_mode(), GLOBAL_STATE.exclusive():
            return self.model.chunk(self._run, inputs, last)

    def _run(self, name, *args, **kwargs):
        arg, out = self.slots[name]
        kwargs[arg] = self.states[name]
        gen = _generator(self.model.compiled[name]) if name in self.rng else None
        if gen is not None:
            outside = gen.get_state()
            gen.set_state(self.rng[name])
        try:
            result = self.model.stock[name](*args, **kwargs)
        finally:
            if gen is not None:
                self.rng[name] = gen.get_state()
                gen.set_state(outside)
        self.states[name] = _clone(result[out])
        return result


def _generator(cs):
    device = next(cs.module.parameters()).device
    return torch.cuda.default_generators[device.index or 0] if device.type == "cuda" \
        else torch.default_generator


def _seeded(cs, seed: int):
    gen = _generator(cs)
    outside = gen.get_state()
    gen.manual_seed(seed)
    start = gen.get_state()
    gen.set_state(outside)
    return start


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


def need(inputs: Tensors, name: str, shape) -> torch.Tensor:
    """``inputs[name]``, checked against ``shape`` (None: any size on that dimension)."""
    t = inputs.get(name)
    if t is None:
        raise ValueError(f"a chunk of this model carries a tensor {name!r} (got "
                         f"{sorted(inputs) or 'none'}); send {{{name!r}: tensor of shape {shape}}}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        raise ValueError(f"{name!r} has shape {tuple(t.shape)}; send shape {shape} "
                         "(None: any size)")
    return t


# -- the models ----------------------------------------------------------------------------------

def _toy(device, cache_dir, full) -> ServedModel:
    import cadence_fx
    from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
    model = PromptRetainedToy(dim=256, heads=4, layers=4).to(device)   # the demo's toy
    adapter = PROMPT_RETAINED_ADAPTER.with_clocks(layers=4, kv_width=2 * 256 // 4)
    c = adapter.clocks
    default = torch.randn(1, c["f_prompt"], 256, generator=torch.Generator().manual_seed(7))

    def start(prompt):   # the priming pass: the stock step on the prompt, no state yet
        x = need(prompt, "prompt", (1, c["f_prompt"], 256)) if prompt else default
        with torch.no_grad():
            _, state = model(x.to(device), None)
        return {"step": {k: v.clone() for k, v in state.items()}}

    def chunk(run, inputs, last):
        x = need(inputs, "x", (1, None, 256)).to(device)
        return {"y": run("step", x)[0]}

    def example(seed, i):
        g = torch.Generator().manual_seed(1000 * seed + i)
        width = c["f_call"] if i == 4 else c["f_chunk"]   # chunk 4: the longer last call
        return {"x": torch.randn(1, width, 256, generator=g)}

    return ServedModel("toy", {"step": model}, {"step": cadence_fx.compile(
        model, adapter, cache_dir=cache_dir)}, start, chunk, example, deadline_ms=160.0,
        warm_chunks=5, config={"dim": 256, "layers": 4, "chunk_frames": c["f_chunk"]})


def _token2wav(device, cache_dir, full) -> ServedModel:
    import cadence_fx
    from cadence_fx import adapters
    from cadence_fx.demo_streams import TOKEN2WAV_FULL, TOKEN2WAV_SMALL
    from cadence_fx.models.token2wav import (FlowStep, HiFTStep, build_flow, build_hift,
                                             empty_hift_cache, prime_flow)
    size = TOKEN2WAV_FULL if (device.type == "cuda" if full is None else full) else TOKEN2WAV_SMALL
    blocks = size["encoder_blocks"]
    if device.type == "cuda":
        cadence_fx.pin_deterministic_kernels()   # stock HiFT is not reproducible without them
    flow = FlowStep(build_flow(size["dit_depth"], blocks=blocks, device=device))
    hift = HiFTStep(build_hift(device=device))
    spk, prompt_state = prime_flow(flow, device=device)   # setup_cache: the default speaker
    adapter = adapters.get("minicpmo-token2wav-flow").with_clocks(conformer_layers=sum(blocks))
    autocast = (lambda: torch.autocast("cuda", dtype=torch.float32)) if device.type == "cuda" \
        else contextlib.nullcontext

    def start(prompt):
        if prompt:
            raise ValueError("token2wav sessions start from the replica's speaker prompt; open "
                             "without tensors")
        return {"flow": prompt_state, "hift": empty_hift_cache(device)}

    def chunk(run, inputs, last):
        tokens = need(inputs, "tokens", (1, 28)).to(device)
        with autocast():
            mel, _ = run("flow", tokens, spk, last_chunk=last)
        pcm, _ = run("hift", mel, last_chunk=last)
        return {"mel": mel, "pcm": pcm}

    def example(seed, i):
        g = torch.Generator().manual_seed(1000 * seed + i)
        return {"tokens": torch.randint(0, 6561, (1, 28), generator=g)}

    compiled = {"flow": cadence_fx.compile(flow, adapter, cache_dir=cache_dir),
                "hift": cadence_fx.compile(hift, "minicpmo-token2wav-hift", cache_dir=cache_dir)}
    return ServedModel("token2wav", {"flow": flow, "hift": hift}, compiled, start, chunk, example,
                       deadline_ms=1000.0, warm_chunks=4, config=dict(size))


def _freeze_omni(device, cache_dir, full) -> ServedModel:
    import cadence_fx
    from cadence_fx.models.freeze_omni import REAL_CONFIG, FreezeOmniEncoder
    enc = FreezeOmniEncoder(**REAL_CONFIG).to(device).eval()

    def start(prompt):
        return {"encoder": enc.initial_state()}

    def chunk(run, inputs, last):
        return {"y": run("encoder", need(inputs, "feats", (1, 16, 80)).to(device))[0]}

    def example(seed, i):
        return {"feats": torch.randn(1, 16, 80, generator=torch.Generator().manual_seed(1000 * seed + i))}

    return ServedModel("freeze-omni", {"encoder": enc}, {"encoder": cadence_fx.compile(
        enc, "freeze-omni", cache_dir=cache_dir)}, start, chunk, example, deadline_ms=160.0,
        warm_chunks=3, config=dict(REAL_CONFIG))


def _moshi(device, cache_dir, full) -> ServedModel:
    import cadence_fx
    from cadence_fx.models import moshi as M
    small = not (device.type == "cuda" if full is None else full)
    mimi = M.build_mimi(device=device)
    lm_gen = M.build_lm_gen(device=device, seed=1, overrides=M.SMALL_LM if small else None,
                            dtype=torch.float32 if small else torch.bfloat16)
    step = M.MoshiStep(mimi, lm_gen)
    compiled = cadence_fx.compile(step, M.moshi_adapter(M.SMALL_LM if small else None),
                                  cache_dir=cache_dir)

    def start(prompt):
        return {"frame": step.initial_state()}

    def chunk(run, inputs, last):
        pcm, tokens, _ = run("frame", need(inputs, "pcm", (1, 1, 1920)).to(device))
        return {} if pcm is None else {"pcm": pcm, "tokens": tokens}   # the LM's delays fill

    def example(seed, i):
        return {"pcm": 0.1 * torch.randn(1, 1, 1920, generator=torch.Generator().manual_seed(1000 * seed + i))}

    return ServedModel("moshi", {"frame": step}, {"frame": compiled}, start, chunk, example,
                       deadline_ms=80.0, warm_chunks=4, config={"lm": "small" if small else "7B"})


_BUILDERS = {"toy": _toy, "token2wav": _token2wav, "freeze-omni": _freeze_omni, "moshi": _moshi}
MODELS = tuple(_BUILDERS)


def build(name: str, device="cpu", cache_dir=None, full: Optional[bool] = None) -> ServedModel:
    """The served model ``name`` on ``device``, its steps compiled with ``cache_dir``: one of
    ``MODELS``, or one's own as ``"package.module:factory"``, where ``factory(device, cache_dir,
    full)`` returns a ``ServedModel`` (each replica imports it, so the module must be importable
    in every replica's process: installed, or on the ``PYTHONPATH`` Ray's workers start with)."""
    if name in _BUILDERS:
        return _BUILDERS[name](torch.device(device), cache_dir, full)
    if ":" not in name:
        raise ValueError(f"no served model {name!r}; choose one of {', '.join(MODELS)}, or give "
                         "your own as 'package.module:factory' (a function of (device, "
                         "cache_dir, full) returning a ServedModel)")
    factory = _factory(name)
    model = factory(torch.device(device), cache_dir, full)
    if not isinstance(model, ServedModel):
        raise TypeError(f"served model {name!r}: {name.partition(':')[2]}(device, cache_dir, full) "
                        f"returned {type(model).__name__}; return a "
                        "cadence_fx.serve.models.ServedModel")
    return model


def _factory(name: str) -> Callable:
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"served model {name!r}: cannot import {module_name!r} ({e}); install it "
                         "or put its folder on PYTHONPATH before Ray starts (each replica "
                         "imports it)") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"served model {name!r}: {module_name!r} has no function {attr!r}; "
                         "name a function of (device, cache_dir, full) returning a ServedModel")
    return factory
