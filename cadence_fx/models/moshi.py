"""The real Moshi code (``moshi==0.2.13``): Mimi streaming codec and the LM step, state made explicit.

The stock classes keep their streaming state in dataclasses hung on each streaming module
(``_streaming_state``: conv ``previous``/``partial`` frames, ``RingKVCache`` buffers, offsets,
execution masks). A compiled step needs that state as arguments, so the thin steps here bind an
explicit ``state`` dict into those dataclasses at the start of each call, run the unchanged stock
methods (``MimiModel.encode``/``decode``, ``LMGen._step``) and hand the dict back. Nothing is
re-implemented: the steps only say where each state tensor lives.

Layout of the state dict (``step.initial_state()`` makes a fresh one, as streaming starts):

- the adapter's regions (``adapters/moshi.py``): the per-layer ring caches stacked,
  ``mimi_encoder_kv``/``mimi_decoder_kv``/``lm_kv`` (each layer's ``RingKVCache.cache`` is bound to
  a view of one slice, so the stock ``scatter_`` writes the stacked tensor), ``mimi_conv_in``
  (the encoder's input conv ``previous``) and ``lm_token_ring`` (``LMGen``'s delayed-token cache);
- every other tensor field, keyed ``"<module path>:<field>"`` (``"encoder.model.3:previous"``,
  ``"decoder_transformer.transformer.layers.0.self_attn:kv_cache.end_offset"``);
- ``lm_offset``: ``LMGen``'s host-side step counter, clipped at ``max_delay + 1`` -- the only value
  of it the stock step reads (it returns no tokens until the delays are filled). A Python int is
  part of the call's signature, so the three warm-up frames and the steady frame are separate
  classes.

``moshi`` imports ``huggingface_hub``, ``sentencepiece`` and ``safetensors`` at module level for
checkpoint loading, which is never used here (weights are seeded random, DESIGN.md); when they are
not installed, empty stand-in modules are registered so the model code imports.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from typing import Dict, List, Optional

import torch
from torch import nn

from cadence_fx.models.explicit_state import ExplicitState

__all__ = ["import_stock", "build_mimi", "build_lm_gen", "MimiStep", "MoshiStep", "SMALL_LM",
           "moshi_adapter", "stock_stream", "randomize"]

# A CPU-sized LM (same architecture and code path as the 7B one) for tests in CI.
SMALL_LM = dict(dim=128, num_heads=4, num_layers=2, hidden_scale=4.125, text_card=512,
                depformer_dim=64, depformer_dim_feedforward=256, depformer_num_heads=2,
                depformer_num_layers=1)


def import_stock() -> types.SimpleNamespace:
    """The stock modules of ``moshi==0.2.13``."""
    if importlib.util.find_spec("moshi") is None:
        raise ImportError("the real Moshi code needs `pip install --no-deps moshi==0.2.13` "
                          "and `pip install einops`")
    _stand_in("huggingface_hub", hf_hub_download=_no_files)
    _stand_in("huggingface_hub.errors", EntryNotFoundError=type("EntryNotFoundError", (Exception,), {}))
    _stand_in("sentencepiece", SentencePieceProcessor=object)
    _stand_in("safetensors")
    _stand_in("safetensors.torch", load_file=_no_files, save_file=_no_files)
    return types.SimpleNamespace(
        loaders=importlib.import_module("moshi.models.loaders"),
        lm=importlib.import_module("moshi.models.lm"),
        transformer=importlib.import_module("moshi.modules.transformer"),
        compile=importlib.import_module("moshi.utils.compile"))


def _no_files(*args, **kwargs):
    raise RuntimeError("cadence_fx builds Moshi with random weights and never loads a file")


def _stand_in(name: str, **attributes) -> None:
    if name in sys.modules:
        return
    try:
        if importlib.util.find_spec(name) is not None:
            return
    except ModuleNotFoundError:  # the parent package is a stand-in without a search path
        pass
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attributes.items():
        setattr(module, key, value)
    sys.modules[name] = module


def randomize(module: nn.Module, seed: int) -> None:
    """Seeded random weights, drawn on the CPU (the same values on every device): matrices
    N(0, 1/fan_in), vectors around 1 for norms and 0 for biases, with small noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.dim() > 1:
                v = r / max(1, p[0].numel()) ** 0.5
            elif name.endswith("bias"):
                v = r * 0.02
            else:
                v = 1 + r * 0.02
            p.copy_(v.to(p.dtype))


def build_mimi(*, seed: int = 0, device="cpu") -> nn.Module:
    """``MimiModel`` exactly as ``loaders.get_mimi(None)`` builds it (8 codebooks), random weights."""
    stock = import_stock()
    torch.manual_seed(seed)
    mimi = stock.loaders.get_mimi(None, device="cpu")
    randomize(mimi, seed)
    return mimi.to(device).eval()


def build_lm_gen(*, seed: int = 0, device="cpu", dtype=torch.bfloat16, overrides=None,
                 **gen_kwargs) -> nn.Module:
    """``LMGen`` over ``loaders.get_moshi_lm(None)`` (the 7B configuration unless ``overrides``
    shrink it, e.g. ``SMALL_LM``), random weights, stock sampling (top-k, temperatures)."""
    stock = import_stock()
    torch.manual_seed(seed)
    lm = stock.loaders.get_moshi_lm(None, device=device, dtype=dtype,
                                    lm_kwargs_overrides=dict(overrides or {}))
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():  # drawn on the device: 7B parameters do not pass through the host
        for name, p in lm.named_parameters():
            r = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
            if p.dim() > 1:
                r = r / max(1, p[0].numel()) ** 0.5
            else:
                r = 1 + r * 0.02
            p.copy_(r.to(p.dtype))
    return stock.lm.LMGen(lm.eval(), **gen_kwargs)


def moshi_adapter(overrides=None):
    """The ``moshi`` adapter with its LM clocks matched to ``build_lm_gen(overrides=...)``
    (``SMALL_LM``); the 7B clocks without overrides."""
    from cadence_fx import adapters
    adapter = adapters.get("moshi")
    if not overrides:
        return adapter
    return adapter.with_clocks(lm_layers=overrides["num_layers"], lm_heads=overrides["num_heads"],
                               lm_head_dim=overrides["dim"] // overrides["num_heads"])


@contextlib.contextmanager
def _plain_eager():
    """The stock code as plain eager PyTorch: the vendor's ``CUDAGraphed`` wrappers and its lazy
    ``torch.compile`` of small functions (rope, RMS norm, gating) switched off by its own switches."""
    vendor = import_stock().compile
    with vendor.no_cuda_graph(), vendor.no_compile():
        yield


_MIMI_STACKS = {"mimi.encoder_transformer.transformer.layers": "mimi_encoder_kv",
                "mimi.decoder_transformer.transformer.layers": "mimi_decoder_kv"}
_MIMI_RENAMES = {"mimi.encoder.model.0:previous": "mimi_conv_in"}


class MimiStep(ExplicitState):
    """One 1920-sample frame through Mimi: ``MimiModel.encode`` then ``decode`` of its codes.

    ``forward(pcm, state) -> (codes, pcm_out, state)``, run as plain eager stock code (the vendor's
    ``CUDAGraphed`` and lazy ``torch.compile`` switched off by its own switches)."""

    def __init__(self, mimi: nn.Module, batch: int = 1):
        super().__init__()
        self.mimi = mimi
        self._setup([mimi], _MIMI_STACKS, _MIMI_RENAMES, batch)

    def _roots(self) -> Dict[str, nn.Module]:
        return {"mimi": self.mimi}

    def forward(self, pcm: torch.Tensor, state: Dict[str, torch.Tensor]):
        slots = self._bind(state)
        with _plain_eager():
            codes = self.mimi.encode(pcm)
            out = self.mimi.decode(codes)
        return codes, out, self._read_back(state, slots)


class MoshiStep(ExplicitState):
    """One full Moshi frame: Mimi encode of the user's 1920 samples, ``LMGen._step`` (main
    transformer, text sampling, depformer over the 8 audio codebooks), Mimi decode of the
    generated audio tokens -- the loop of ``moshi/server.py``.

    ``forward(pcm, state) -> (pcm_out, tokens, state)``; ``pcm_out`` and ``tokens`` are None while
    the LM's delays fill (the first ``max_delay + 1`` frames of a turn), as in the stock loop."""

    def __init__(self, mimi: nn.Module, lm_gen: nn.Module, batch: int = 1):
        super().__init__()
        self.mimi, self.lm_gen = mimi, lm_gen
        self._setup([lm_gen, mimi], dict(_MIMI_STACKS, **{"lm_gen.lm_model.transformer.layers": "lm_kv"}),
                    dict(_MIMI_RENAMES, **{"lm_gen:cache": "lm_token_ring"}), batch)
        self._initial["lm_offset"] = self._first["lm_offset"] = 0

    def _roots(self) -> Dict[str, nn.Module]:
        # LMGen keeps its LM streaming (detached) inside its own state: bind both.
        return {"mimi": self.mimi, "lm_gen": self.lm_gen, "lm_gen.lm_model": self.lm_gen.lm_model}

    def forward(self, pcm: torch.Tensor, state: Dict[str, torch.Tensor]):
        slots = self._bind(state)
        gen = self.lm_gen._streaming_state
        gen.offset_cpu = state["lm_offset"]
        with _plain_eager():
            codes = self.mimi.encode(pcm)
            result = self.lm_gen._step(codes)
            out = None
            tokens = None
            if result is not None:
                tokens = result[0]
                out = self.mimi.decode(tokens[:, 1:])
        new = self._read_back(state, slots)
        new["lm_offset"] = min(gen.offset_cpu, self.lm_gen.max_delay + 1)
        return out, tokens, new


def stock_stream(mimi: nn.Module, lm_gen: Optional[nn.Module], frames: List[torch.Tensor],
                 reset_at: Optional[int] = None, *, as_shipped: bool = False, on_frame=None):
    """The stock streaming loop, as ``moshi/server.py`` runs it: per frame ``mimi.encode``,
    ``lm_gen.step``, ``mimi.decode`` (without ``lm_gen``: encode then decode of the codes). A turn
    boundary at ``reset_at`` calls the stock ``reset_streaming``. By default plain eager;
    ``as_shipped`` leaves the vendor's ``CUDAGraphed`` wrappers (CUDA only) and lazy
    ``torch.compile`` on. ``on_frame(i)`` is called before and after each frame (timing).
    Returns one output per frame: ``(codes, pcm_out)`` without the LM, else ``(pcm_out, tokens)``
    (None, None while the LM's delays fill)."""
    outs = []
    with contextlib.ExitStack() as stack:
        if not as_shipped:
            stack.enter_context(_plain_eager())
        stack.enter_context(mimi.streaming(1))
        if lm_gen is not None:
            stack.enter_context(lm_gen.streaming(1))
        for i, frame in enumerate(frames):
            if i == reset_at:
                mimi.reset_streaming()
                if lm_gen is not None:
                    lm_gen.reset_streaming()
            if on_frame is not None:
                on_frame(i)
            with torch.no_grad():
                codes = mimi.encode(frame)
                if lm_gen is None:
                    outs.append((codes.clone(), mimi.decode(codes).clone()))
                else:
                    tokens = lm_gen.step(codes)
                    if tokens is None:
                        outs.append((None, None))
                    else:
                        outs.append((mimi.decode(tokens[:, 1:]).clone(), tokens.clone()))
            if on_frame is not None:
                on_frame(i)
    return outs
