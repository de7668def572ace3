"""The real MiniCPM-o 4.5 / Step-Audio2 Token2Wav flow decoder, built from ``minicpmo==0.1.2``.

The stock classes are imported without running ``stepaudio2/__init__.py`` (which pulls in
torchaudio, s3tokenizer and hyperpyyaml for the tokenizer and file loading, none of which the flow
decoder uses); ``flow_matching.py`` imports onnxruntime at the top without using it, so an empty
stand-in module is registered when onnxruntime is not installed. Weights are seeded random at the
real configuration; the layers the stock code zero-initialises are re-randomised, otherwise the
computation would be trivial.

``FlowStep`` is the flow half of ``Token2wav.stream``: ``CausalMaskedDiffWithXvec.inference_chunk``
(conformer encoder + CFM) and the retention of both attention caches. ``CFMStep`` is the thin step: ``CausalConditionalCFM.forward_chunk`` followed by the retention
exactly as ``stepaudio2/token2wav.py`` applies it to ``estimator_att_cache`` (prompt + last 100
frames, along dim 4). ``HiFTStep`` is the vocoder half of ``Token2wav.stream``: the stock
``HiFTGenerator`` with its mel/source/speech caches and the overlap fade; it draws device
randomness on every call and its ``istft`` stays eager.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from typing import Dict, Optional, Tuple

import numpy as np
import torch
from torch import nn

__all__ = ["import_stock", "build_cfm", "CFMStep", "prime_cfm", "build_hift", "HiFTStep",
           "empty_hift_cache", "build_flow", "FlowStep", "prime_flow", "prompt_call",
           "stock_conversation"]

DIT_CONFIG = dict(in_channels=320, out_channels=80, mlp_ratio=4, num_heads=8, head_dim=64,
                  hidden_size=512)


def import_stock() -> types.SimpleNamespace:
    """The stock flow modules of ``minicpmo==0.1.2`` (package ``stepaudio2``)."""
    spec = importlib.util.find_spec("stepaudio2")
    if spec is None:
        raise ImportError("the real Token2Wav code needs `pip install --no-deps minicpmo==0.1.2` "
                          "and `pip install einops`")
    if "onnxruntime" not in sys.modules and importlib.util.find_spec("onnxruntime") is None:
        stand_in = types.ModuleType("onnxruntime")
        stand_in.__spec__ = importlib.machinery.ModuleSpec("onnxruntime", None)
        sys.modules["onnxruntime"] = stand_in
    if "stepaudio2" not in sys.modules:
        pkg = types.ModuleType("stepaudio2")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["stepaudio2"] = pkg
    return types.SimpleNamespace(
        flow_matching=importlib.import_module("stepaudio2.cosyvoice2.flow.flow_matching"),
        decoder_dit=importlib.import_module("stepaudio2.cosyvoice2.flow.decoder_dit"),
        hifigan=importlib.import_module("stepaudio2.flashcosyvoice.modules.hifigan"),
        flow=importlib.import_module("stepaudio2.cosyvoice2.flow.flow"),
        encoder=importlib.import_module("stepaudio2.cosyvoice2.transformer.upsample_encoder_v2"))


def build_cfm(depth: int = 16, *, seed: int = 0, device="cpu", cfg_rate: float = 0.7) -> nn.Module:
    """``CausalConditionalCFM`` with the real DiT configuration at ``depth`` blocks, random weights."""
    stock = import_stock()
    torch.manual_seed(seed)
    dit = stock.decoder_dit.DiT(depth=depth, **DIT_CONFIG)
    # re-randomise everything, the adaLN-Zero and output layers included
    _randomize(dit.parameters(), seed, lambda p, r: r * (0.02 if p.dim() > 1 else 0.01))
    cfm = stock.flow_matching.CausalConditionalCFM(dit, inference_cfg_rate=cfg_rate)
    return cfm.to(device).eval()


def _randomize(params, seed: int, value) -> None:
    """Seeded random weights: each parameter ``p`` becomes ``value(p, standard normal draw)``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(value(p, torch.randn(p.shape, generator=g)))


class CFMStep(nn.Module):
    """One streaming chunk of the CFM decoder, then Token2Wav's retention of the attention cache."""

    def __init__(self, cfm: nn.Module, prompt_frames: int = 302, retained_frames: int = 100,
                 n_timesteps: int = 10):
        super().__init__()
        self.cfm = cfm
        self.prompt_frames, self.retained_frames, self.n_timesteps = (
            prompt_frames, retained_frames, n_timesteps)

    def forward(self, mu, spks, cond, cache: Dict[str, torch.Tensor]):
        mel, cnn, att = self.cfm.forward_chunk(
            mu, spks, cond, n_timesteps=self.n_timesteps, temperature=1.0,
            cnn_cache=cache["estimator_cnn_cache"] if cache else None,
            att_cache=cache["estimator_att_cache"] if cache else None)
        p, r = self.prompt_frames, self.retained_frames
        if att.shape[4] > p + r:  # as stepaudio2/token2wav.py, Token2wav.stream
            att = torch.cat([att[:, :, :, :, :p], att[:, :, :, :, -r:]], dim=4)
        return mel, {"estimator_cnn_cache": cnn, "estimator_att_cache": att}


def prime_cfm(step: CFMStep, *, seed: int = 1, device="cpu") -> Tuple[torch.Tensor, Dict]:
    """The cache-free prompt-priming pass (eager by construction); returns ``(spks, prompt state)``
    with the state cloned, as a caller restoring it at turn boundaries would keep it."""
    g = torch.Generator().manual_seed(seed)
    p = step.prompt_frames
    mu = torch.randn(1, 80, p, generator=g).to(device)
    cond = torch.randn(1, 80, p, generator=g).to(device)
    spks = torch.randn(1, 80, generator=g).to(device)
    with torch.inference_mode():
        _, state = step(mu, spks, cond, None)
    return spks, {k: v.clone() for k, v in state.items()}


def build_hift(*, seed: int = 0, device="cpu") -> nn.Module:
    """The stock ``HiFTGenerator`` at its default (Token2Wav) configuration, random weights."""
    stock = import_stock()
    torch.manual_seed(seed)
    hift = stock.hifigan.HiFTGenerator()
    _randomize(hift.parameters(), seed, lambda p, r: r * 0.05 + (0.05 if p.dim() == 1 else 0.0))
    return hift.to(device).eval()


def empty_hift_cache(device="cpu", mel_bins: int = 80) -> Dict[str, torch.Tensor]:
    """The vocoder caches at the start of a turn, as ``Token2wav.set_stream_cache`` makes them."""
    return {"mel": torch.zeros(1, mel_bins, 0, device=device),
            "source": torch.zeros(1, 1, 0, device=device),
            "speech": torch.zeros(1, 0, device=device)}


class HiFTStep(nn.Module):
    """The vocoder part of ``Token2wav.stream`` (stepaudio2/token2wav.py), unchanged: mel and
    source caches feed the stock ``HiFTGenerator``, the speech cache is faded in, the caches keep
    the last 8 mel frames and 8 * 480 samples. ``fade_in_out`` is the stock module-level helper
    (restated here because its module imports torchaudio at the top)."""

    def __init__(self, hift: nn.Module, mel_cache_len: int = 8):
        super().__init__()
        self.hift = hift
        self.mel_cache_len = mel_cache_len
        self.source_cache_len = mel_cache_len * 480
        window = torch.from_numpy(np.hamming(2 * self.source_cache_len))  # float64, as stock
        window = window.to(next(hift.parameters()).device)
        self.register_buffer("speech_window", window, persistent=False)

    def forward(self, chunk_mel: torch.Tensor, hift_cache: Dict[str, torch.Tensor],
                last_chunk: bool = False):
        mel = torch.concat([hift_cache["mel"], chunk_mel], dim=2)
        speech, source = self.hift(mel, hift_cache["source"])
        if hift_cache["speech"].shape[-1] > 0:
            speech = _fade_in_out(speech, hift_cache["speech"], self.speech_window)
        is_first_chunk = hift_cache["speech"].shape[-1] == 0
        new_cache = {"mel": mel[..., -self.mel_cache_len:].clone().detach(),
                     "source": source[:, :, -self.source_cache_len:].clone().detach(),
                     "speech": speech[:, -self.source_cache_len:].clone().detach()}
        if not last_chunk:
            if is_first_chunk:
                silence = torch.zeros(1, self.source_cache_len, device=speech.device)
                speech = torch.cat([silence, speech[:, :-self.source_cache_len]], dim=1)
            else:
                speech = speech[:, :-self.source_cache_len]
        return speech, new_cache


def _fade_in_out(fade_in_mel, fade_out_mel, window):
    """``fade_in_out`` of stepaudio2/token2wav.py."""
    mel_overlap_len = int(window.shape[0] / 2)
    fade_in_mel = fade_in_mel.clone()
    fade_in_mel[..., :mel_overlap_len] = \
        fade_in_mel[..., :mel_overlap_len] * window[:mel_overlap_len] + \
        fade_out_mel[..., -mel_overlap_len:] * window[mel_overlap_len:]
    return fade_in_mel


ENCODER_CONFIG = dict(input_size=512, output_size=512, attention_heads=8, linear_units=2048,
                      num_blocks=6, num_up_blocks=4, pre_lookahead_len=3, up_stride=2)


def build_flow(depth: int = 16, *, blocks=(6, 4), seed: int = 0, device="cpu") -> nn.Module:
    """``CausalMaskedDiffWithXvec``: the real UpsampleConformerEncoderV2 (512 wide, 8 heads, 2048
    FFN, 6 + 4 blocks, look-ahead 3, up-stride 2) and the CFM decoder at ``depth``, random
    weights. ``blocks`` = (blocks before, after upsampling) shrinks the encoder for CPU tests."""
    stock = import_stock()
    torch.manual_seed(seed)
    config = dict(ENCODER_CONFIG, num_blocks=blocks[0], num_up_blocks=blocks[1])
    encoder = stock.encoder.UpsampleConformerEncoderV2(**config)
    flow = stock.flow.CausalMaskedDiffWithXvec(
        input_size=512, output_size=80, spk_embed_dim=192, vocab_size=6561, encoder=encoder,
        decoder=build_cfm(depth, seed=seed))
    _randomize((p for name, p in flow.named_parameters() if not name.startswith("decoder.")),
               seed + 1, lambda p, r: r * 0.02)
    return flow.to(device).eval()


class FlowStep(nn.Module):
    """One streaming chunk of the flow, then Token2Wav's retention of both attention caches
    (``Token2wav.stream``: prompt + last 100 frames, dims 4 and 3). With ``cache=None`` the call
    is the speaker's priming pass, ``flow.setup_cache(token, prompt_mel, spk)`` as
    ``Token2wav.set_stream_cache`` makes it: ``token`` is the prompt's tokens with the 3
    look-ahead tokens, ``prompt_mel`` its (1, frames, 80) mel; it returns ``(None, cache)``."""

    def __init__(self, flow: nn.Module, prompt_frames: int = 302, retained_frames: int = 100,
                 n_timesteps: int = 10):
        super().__init__()
        self.flow = flow
        self.prompt_frames, self.retained_frames, self.n_timesteps = (
            prompt_frames, retained_frames, n_timesteps)

    def forward(self, token, spk, cache: Optional[Dict[str, torch.Tensor]], last_chunk: bool = False,
                prompt_mel: Optional[torch.Tensor] = None):
        if cache is None:
            return None, self.flow.setup_cache(token, prompt_mel, spk, n_timesteps=self.n_timesteps)
        mel, cache = self.flow.inference_chunk(token=token, spk=spk, cache=cache,
                                               last_chunk=last_chunk, n_timesteps=self.n_timesteps)
        p, r = self.prompt_frames, self.retained_frames
        cache = dict(cache)
        if cache["estimator_att_cache"].shape[4] > p + r:
            att = cache["estimator_att_cache"]
            cache["estimator_att_cache"] = torch.cat([att[:, :, :, :, :p], att[:, :, :, :, -r:]], dim=4)
        if cache["conformer_att_cache"].shape[3] > p + r:
            att = cache["conformer_att_cache"]
            cache["conformer_att_cache"] = torch.cat([att[:, :, :, :p, :], att[:, :, :, -r:, :]], dim=3)
        return mel, cache


def prompt_call(step: FlowStep, *, seed: int = 1, device="cpu", frames: Optional[int] = None):
    """A synthetic speaker prompt: ``(tokens, mel, spk)`` with ``frames // 2`` tokens + 3
    look-ahead (default ``frames``: the step's 302 prompt frames). ``step(tokens, spk, None,
    prompt_mel=mel)`` primes through the step (a compiled priming class)."""
    frames = step.prompt_frames if frames is None else frames
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 6561, (1, frames // 2 + 3), generator=g).to(device)
    mel = torch.randn(1, frames, 80, generator=g).to(device)
    spk = torch.randn(1, 192, generator=g).to(device)
    return tokens, mel, spk


def prime_flow(step: FlowStep, *, seed: int = 1, device="cpu"):
    """``setup_cache`` on a synthetic prompt (151 tokens + 3 look-ahead, 302 mel frames), eager
    by construction; returns ``(spk, prompt state)``, the state cloned as a caller keeps it."""
    tokens, mel, spk = prompt_call(step, seed=seed, device=device)
    with torch.inference_mode():
        state = step.flow.setup_cache(tokens, mel, spk, n_timesteps=step.n_timesteps)
    return spk, {k: v.clone() for k, v in state.items()}


def stock_conversation(flow: FlowStep, hift: HiFTStep, prompt, tokens, *, seed: int,
                       device="cpu"):
    """One speaker through stock, as a reference: primed on ``prompt`` (``prompt_call``'s
    ``(tokens, mel, spk)``), then each chunk of ``tokens`` through the flow and HiFT, with the
    device's generator seeded ``seed`` (HiFT draws from it) and put back afterwards. Returns each
    chunk's ``(mel, PCM)`` on the host; states are cloned between calls, as a caller keeps them."""
    prompt_tokens, mel_p, spk = prompt
    gen = torch.cuda.default_generators[0] if torch.device(device).type == "cuda" \
        else torch.default_generator
    outside = gen.get_state()
    gen.manual_seed(seed)
    out = []
    try:
        with torch.inference_mode(), torch.autocast(torch.device(device).type, dtype=torch.float32,
                                                    enabled=torch.device(device).type == "cuda"):
            state = {k: v.clone() for k, v in flow(prompt_tokens, spk, None,
                                                   prompt_mel=mel_p)[1].items()}
            cache = empty_hift_cache(device)
            for tok in tokens:
                mel, state = flow(tok, spk, state)
                state = {k: v.clone() for k, v in state.items()}
                pcm, cache = hift(mel, cache)
                cache = {k: v.clone() for k, v in cache.items()}
                out.append((mel.cpu(), pcm.cpu()))
    finally:
        gen.set_state(outside)
    return out
