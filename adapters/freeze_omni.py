"""Freeze-Omni streaming speech encoder: conv subsampling + chunked self-attention, bounded left context.

Freeze-Omni has no package, so these numbers are a declared operating point, not read from a config
file. They follow the public inference code (VITA-MLLM/Freeze-Omni ``bin/inference_stream.py`` and
``models/encoder``):

- Input: 80-bin Kaldi fbank, 10 ms shift. One call feeds one chunk of 16 new fbank frames (160 ms).
- The 4x conv subsampling front end needs 3 fbank frames of left context: the stock processor keeps
  them as ``chunk_overlap = 3`` in a zero-filled (1, 16 + 3, 80) buffer. That is the conv left-context
  region; it is full size from the first call (start = window), so K = 1.
- After 4x subsampling a chunk is 4 encoder frames. Attention (``MultiHeadedAttention.infer``) appends
  the chunk's keys and values to a per-layer cache and keeps the last ``chunk_size * left_chunks``
  frames. The chunk policy is the operator's choice (the paper's condition C2); we fix
  ``left_chunks = 1``: one chunk of left context. The cache is empty on the first call and holds
  4 frames on every later one: extents {0, 4}, K = 2 (the paper's Freeze-Omni width). A wider policy
  of L left chunks gives K = L + 1 (eq. 7), still admissible for L < 64.
- Encoder size: 24 blocks, 1024 wide, 16 heads (head dim 64), fp32; these set bytes only, never K.

Step: ``cadence_fx.models.freeze_omni.FreezeOmniEncoder.forward(feats, state) -> (enc_out, state)``
with ``feats`` the (batch, 16, 80) new fbank frames and ``state`` a dict returned as result 1:

- ``state.att_cache``: (layers, 2, batch, heads, frames, head_dim), the per-layer key/value buffers
  stacked; new frames are appended.
- ``state.conv_left``: (batch, 3, 80), the last 3 fbank frames of the previous chunk.
- ``state.offset``: (1,) int64, the frame position (a plain argument).

Stock code grows the attention cache with ``torch.cat`` and slices it back each chunk (a new tensor per
call) rather than over-reserving, so no stock envelope is declared. The final partial chunk is
zero-padded to 16 frames by the stock sender, so no partial calls exist: no admission clock.
"""
from __future__ import annotations

from cadence_fx.contract import APPEND, Adapter, Region, SlidingWindow

__all__ = ["ADAPTERS", "CLOCKS", "FREEZE_OMNI"]

CLOCKS = {
    "fbank_chunk": 16, "fbank_bins": 80, "conv_left": 3, "subsampling": 4,
    "enc_chunk": 4,      # fbank_chunk / subsampling: encoder frames per call
    "left_context": 4,   # enc_chunk * left_chunks (left_chunks = 1)
    "layers": 24, "heads": 16, "head_dim": 64, "batch": 1,
}

ATT_CACHE = Region(
    name="att_cache", input="state.att_cache", output="1.att_cache", dim=4,
    retention=SlidingWindow("left_context"), advance="enc_chunk", ordering=APPEND,
    shape=("layers", 2, "batch", "heads", None, "head_dim"))
CONV_LEFT = Region(
    name="conv_left", input="state.conv_left", output="1.conv_left", dim=1,
    retention=SlidingWindow("conv_left", start="conv_left"), advance="fbank_chunk", ordering=APPEND,
    shape=("batch", None, "fbank_bins"))

FREEZE_OMNI = Adapter(
    name="freeze-omni",
    clocks=CLOCKS,
    regions=(ATT_CACHE, CONV_LEFT),
    call_frames=("fbank_chunk",),
    call_input="feats", call_dim=1,
    description="Freeze-Omni streaming encoder: 4x conv subsampling + chunked attention, 1 left chunk",
)

ADAPTERS = {"freeze-omni": FREEZE_OMNI}
