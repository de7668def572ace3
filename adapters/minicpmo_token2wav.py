"""MiniCPM-o 4.5 / Step-Audio2 Token2Wav (CosyVoice2 lineage): flow decoder + HiFT vocoder.

Numbers from the stock streaming loop (``stepaudio2/token2wav.py``) and the paper's operating point:
302 prompt frames, retention to prompt + 100 frames, 50-frame chunks (25 tokens at 2 frames per token),
a 56-frame last call (the 3 look-ahead tokens kept), 10 Euler steps, CFG doubling the batch to 2.
The estimator's stock envelope is ``att_cache_buffer`` of (16, 16, 2, 8, 1000, 128) fp32; new frames are
prepended, so the mutable history precedes the immutable prompt tail. Its conv state lives in
``cnn_cache_buffer`` (16, 16, 2, 1024, 2): a fixed two-frame context, one extent, 10 of 16 slots used.
"""
import dataclasses

from cadence_fx.contract import (APPEND, PREPEND, Adapter, Effects, PromptRetained, Region, Ring,
                                 SlidingWindow)

CLOCKS = {
    "f_prompt": 302, "f_retained": 100, "f_chunk": 50, "f_call": 56, "n_steps": 10,
    "frames_per_token": 2,
    # layer and head counts of the real configuration (DiT depth 16, conformer 6 + 4 blocks)
    "dit_depth": 16, "conformer_layers": 10, "heads": 8, "kv_width": 128, "cfg_batch": 2, "batch": 1,
    "stock_steps": 16, "stock_frames": 1000,
    # the DiT blocks' causal convs keep kernel - 1 = 2 frames of 512 + 512 channels per block
    "cnn_context": 2, "conv_channels": 1024,
    # HiFT stream caches: 8 mel frames, 8 * 480 samples of source and speech
    "mel_bins": 80, "mel_cache": 8, "wave_cache": 3840, "samples_per_frame": 480,
    # a flow call takes 25 new tokens + 3 look-ahead tokens
    "chunk_tokens": 28,
    # the priming pass reads the prompt's 151 tokens + 3 look-ahead (f_prompt / 2 + 3)
    "prompt_tokens": 154,
}

ESTIMATOR_ATT = Region(
    name="estimator_att_cache", input="cache.estimator_att_cache", output="1.estimator_att_cache",
    dim=4, retention=PromptRetained("f_prompt", "f_retained"), advance="f_chunk", ordering=PREPEND,
    shape=("n_steps", "dit_depth", "cfg_batch", "heads", None, "kv_width"),
    # the stock envelope holds a row per DiT block (16 in the real configuration)
    stock_shape=("stock_steps", "dit_depth", "cfg_batch", "heads", "stock_frames", "kv_width"),
    # the 56-frame last call is written into the envelope before retention: declared, because the
    # flow step counts its calls in tokens, from which the default room cannot be read
    envelope="att_cache_buffer", room="f_call")
ESTIMATOR_CNN = Region(
    name="estimator_cnn_cache", input="cache.estimator_cnn_cache", output="1.estimator_cnn_cache",
    dim=4, retention=Ring("cnn_context"), advance="f_chunk", ordering=APPEND,
    shape=("n_steps", "dit_depth", "cfg_batch", "conv_channels", None),
    stock_shape=("stock_steps", "dit_depth", "cfg_batch", "conv_channels", "cnn_context"),
    envelope="cnn_cache_buffer")
CONFORMER_ATT = Region(
    name="conformer_att_cache", input="cache.conformer_att_cache", output="1.conformer_att_cache",
    dim=3, retention=PromptRetained("f_prompt", "f_retained"), advance="f_chunk", ordering=PREPEND,
    shape=("conformer_layers", "batch", "heads", None, "kv_width"))
HIFT_MEL = Region(
    name="hift_mel_cache", input="hift_cache.mel", output="1.mel", dim=2,
    retention=SlidingWindow("mel_cache"), advance="f_chunk", ordering=APPEND,
    room="f_call",   # the last call of a turn appends 56 frames before the window keeps 8
    shape=("batch", "mel_bins", None))
HIFT_SOURCE = Region(
    name="hift_source_cache", input="hift_cache.source", output="1.source", dim=2,
    retention=SlidingWindow("wave_cache"), advance="wave_cache", ordering=APPEND,
    shape=("batch", 1, None))
HIFT_SPEECH = Region(
    name="hift_speech_cache", input="hift_cache.speech", output="1.speech", dim=1,
    retention=SlidingWindow("wave_cache"), advance="wave_cache", ordering=APPEND,
    shape=("batch", None))

TOKEN2WAV = Adapter(
    name="minicpmo-token2wav",
    clocks=CLOCKS,
    regions=(ESTIMATOR_ATT, ESTIMATOR_CNN, CONFORMER_ATT, HIFT_MEL, HIFT_SOURCE, HIFT_SPEECH),
    call_frames=("f_chunk", "f_call"),
    call_input="mu", call_dim=2,
    admission="f_chunk",
    # HiFT copies its STFT window to the device on every call; the DiT frequency table (an
    # arange) and SineGen's harmonic multipliers (a literal) are found without a declaration.
    constants=("stft_window",),
    effects=Effects(device_rng=True),
    # the DiT runs once per Euler step with the same shapes: traced once, copied 9 times
    repeated=("estimator.forward_chunk",),
    description="MiniCPM-o 4.5 Token2Wav: CFM flow decoder (DiT, 10 Euler steps) + HiFT vocoder",
)

# The vocoder step (``cadence_fx.models.token2wav.HiFTStep``): its three caches, read from
# ``hift_cache`` and returned as the second result; the call width is the mel chunk's.
TOKEN2WAV_HIFT = dataclasses.replace(
    TOKEN2WAV, name="minicpmo-token2wav-hift", regions=(HIFT_MEL, HIFT_SOURCE, HIFT_SPEECH),
    call_input="chunk_mel", call_dim=2, repeated=(),
    description="MiniCPM-o 4.5 Token2Wav vocoder (HiFT) with its mel/source/speech caches")

# The flow step (``cadence_fx.models.token2wav.FlowStep``: encoder + CFM + retention): three
# fixed-address regions; the call width is counted in tokens.
TOKEN2WAV_FLOW = dataclasses.replace(
    TOKEN2WAV, name="minicpmo-token2wav-flow", regions=(ESTIMATOR_ATT, ESTIMATOR_CNN, CONFORMER_ATT),
    call_frames=("chunk_tokens",), call_input="token", call_dim=1, admission="chunk_tokens",
    # the CFM's noise is its fixed ``rand_noise`` buffer, sliced: the flow draws no randomness
    # (the vocoder's SineGen does). Declared, a SessionPool would give each session a generator
    # state and make its lanes take turns on the device for nothing; a draw the flow did make
    # would be refused at its probationary call (``class_compiler``), never served shared.
    effects=Effects(),
    # a server primes each new speaker with the flow's own cache-free prompt pass
    priming=("flow.setup_cache",),
    # the prompt lengths the server accepts, in tokens: retention keeps the first f_prompt
    # frames, so every catalog class assumes a prompt of exactly f_prompt frames; a server with
    # other prompt lengths serves each through a step compiled at with_clocks(f_prompt=...,
    # prompt_tokens=...)
    prompt_lengths=("prompt_tokens",),
    description="MiniCPM-o 4.5 Token2Wav flow: conformer encoder + CFM decoder")

# The CFM decoder step alone (``cadence_fx.models.token2wav.CFMStep``: the DiT solver loop +
# retention of its attention cache): the two estimator regions, the call width in mel frames.
TOKEN2WAV_CFM = dataclasses.replace(
    TOKEN2WAV, name="minicpmo-token2wav-cfm", regions=(ESTIMATOR_ATT, ESTIMATOR_CNN),
    description="MiniCPM-o 4.5 Token2Wav CFM decoder (DiT, 10 Euler steps) with its caches")

ADAPTERS = {"minicpmo-token2wav": TOKEN2WAV, "minicpmo-token2wav-hift": TOKEN2WAV_HIFT,
            "minicpmo-token2wav-flow": TOKEN2WAV_FLOW, "minicpmo-token2wav-cfm": TOKEN2WAV_CFM}
