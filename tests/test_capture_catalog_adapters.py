"""``capture_catalog`` on the step of every registered adapter, and on low-rank arguments.

For each adapter in ``adapters.names()``: its step built small on the CPU, one example call to
``capture_catalog``, which must compile every class of the catalog (or, for the excluded
``llm-backbone``, refuse every one for Criterion 3.5) and leave counters and arguments as they
were; then a short real stream with a turn reset, bit-exact against the stock step, in which
every call runs compiled and nothing new is traced. Host values are part of a class's
signature and ``capture_catalog`` takes them from its example: Token2Wav's ``last_chunk`` flag
gets one more ``prepare``, Moshi's ``lm_offset`` one example per value.

The real-model cases skip only when a third-party package is absent (``stock_packages``).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cadence_fx
from cadence_fx import adapters
from cadence_fx.contract import APPEND, Adapter, Region, SlidingWindow
from cadence_fx.counters import Counters
from helpers import clone, stream
from stock_packages import MOSHI, TOKEN2WAV, require


def _same(stock, ours) -> bool:
    """Equal bit for bit; a stock tensor may be larger than ours only where the stock code
    over-reserves (Token2Wav's solver-step slots), and its extra entries must be zero."""
    if isinstance(stock, torch.Tensor) or isinstance(ours, torch.Tensor):
        if not (isinstance(stock, torch.Tensor) and isinstance(ours, torch.Tensor)
                and stock.dtype == ours.dtype and stock.dim() == ours.dim()):
            return False
        if stock.shape == ours.shape:
            return torch.equal(stock, ours)
        if any(s < o for s, o in zip(stock.shape, ours.shape)):
            return False
        cut = stock[tuple(slice(0, n) for n in ours.shape)]
        return torch.equal(cut, ours) and stock.count_nonzero() == cut.count_nonzero()
    if isinstance(stock, dict):
        return (isinstance(ours, dict) and stock.keys() == ours.keys()
                and all(_same(stock[k], ours[k]) for k in stock))
    if isinstance(stock, (tuple, list)):
        return (isinstance(ours, (tuple, list)) and len(stock) == len(ours)
                and all(map(_same, stock, ours)))
    return stock == ours


def _capture(c, mode, *args, **kwargs):
    """``capture_catalog`` under ``mode``: returns its verdicts, checking that it left the
    example and the counters as they were."""
    before = clone((args, kwargs))
    with mode():
        done = c.capture_catalog(*args, **kwargs)
    assert _same(before, (args, kwargs))
    assert c.counters.as_dict() == Counters().as_dict()   # preparing is not traffic
    return done


def _all_compiled(c, done):
    assert done == {cls: True for cls in c.catalog.classes}
    assert {e.key[0] for e in c.classes.values()} == set(c.catalog.classes)


def _stream_checks(c, want, got, classes):
    """Bit-exact, every call compiled, nothing traced after the capture."""
    assert [_same(w, g) for w, g in zip(want, got)] == [True] * len(want) and len(got) == len(want)
    k = c.counters
    n = len(want)
    assert (k.calls, k.compiled_calls, k.fallbacks, dict(k.reasons)) == (n, n, 0, {})
    assert k.traces == 0 and len(c.classes) == classes
    assert k.carry_addresses == 1


# -- a toy step whose arguments include tensors of rank <= call_dim ------------------------------

class LowRankArgs(nn.Module):
    """(1, dim, T) frames with a 2-frame left context; besides them a (1,) int64 offset, a 0-d
    gain and a (1, dim) bias: every rank from 0 to ``call_dim`` = 2."""

    def __init__(self, dim: int = 8, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.mix = nn.Linear(dim, dim)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x, cache, offset, gain, bias):
        xc = torch.cat([cache, x], dim=2)
        y = self.mix(xc.transpose(1, 2)).transpose(1, 2) * gain + bias.unsqueeze(-1)
        y = y + 0.01 * offset.to(y.dtype)
        return y[:, :, -x.shape[2]:], xc[:, :, -2:], offset + x.shape[2]


LOW_RANK_ADAPTER = Adapter(
    name="toy-low-rank-args", clocks={"ctx": 2, "f_chunk": 4, "f_call": 6, "dim": 8, "batch": 1},
    regions=(Region(name="ctx", input="cache", output="1", dim=2, retention=SlidingWindow("ctx"),
                    advance="f_chunk", ordering=APPEND, shape=("batch", "dim", None)),),
    call_frames=("f_chunk", "f_call"), call_input="x", call_dim=2)


def test_capture_catalog_with_0d_and_low_rank_tensor_arguments():
    """A 0-d tensor argument (ZeroDivisionError) and ones of rank <= call_dim (IndexError) once
    crashed the re-cut; they pass through as given, only the call input is re-made."""
    m = LowRankArgs()
    c = cadence_fx.compile(m, LOW_RANK_ADAPTER)
    g = torch.Generator().manual_seed(1)
    offset, gain, bias = torch.tensor([3]), torch.tensor(0.5), torch.randn(1, 8, generator=g)
    done = _capture(c, torch.no_grad, torch.randn(1, 8, 4, generator=g), torch.zeros(1, 8, 0),
                    offset, gain, bias)
    assert len(done) == 4   # extents {0, 2} x widths {4, 6}
    _all_compiled(c, done)
    xs = [torch.randn(1, 8, w, generator=g) for w in (4, 4, 6, 4, 6)]

    def run(step):
        outs, cache, off = [], torch.zeros(1, 8, 0), offset
        for i, x in enumerate(xs):
            if i == 3:
                cache, off = torch.zeros(1, 8, 0), offset   # turn reset
            with torch.no_grad():
                y, cache, off = step(x, cache, off, gain, bias)
            outs.append(clone((y, cache, off)))
        return outs

    _stream_checks(c, run(m), run(c), classes=4)


# -- the registered adapters ----------------------------------------------------------------------

class TinyDecoder(nn.Module):
    """The ``llm-backbone`` step, small: one token per call, stacked per-layer K/V kept as the
    last ``window`` frames of ``cat([cache, new])``, a (1,) int64 position."""

    def __init__(self, layers=1, kv_heads=2, head_dim=8, window=4, vocab=32, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        dim = kv_heads * head_dim
        self.heads, self.head_dim, self.window = kv_heads, head_dim, window
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.out = nn.Linear(dim, vocab)
        self.register_buffer("pe", torch.randn(64, dim, generator=g), persistent=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def initial_state(self):
        return {"kv": torch.zeros(len(self.qkv), 2, 1, self.heads, 0, self.head_dim),
                "pos": torch.zeros(1, dtype=torch.long)}

    def forward(self, input_ids, state):
        b, t = input_ids.shape
        h = self.emb(input_ids) + self.pe.index_select(0, state["pos"])
        caches = []
        for i, qkv in enumerate(self.qkv):
            q, k, v = (z.reshape(b, t, self.heads, self.head_dim).transpose(1, 2)
                       for z in qkv(h).chunk(3, dim=-1))
            k = torch.cat([state["kv"][i, 0], k], dim=2)[:, :, -self.window:]
            v = torch.cat([state["kv"][i, 1], v], dim=2)[:, :, -self.window:]
            h = h + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
            caches.append(torch.stack([k, v]))
        return self.out(h), {"kv": torch.stack(caches), "pos": state["pos"] + t}


def _decoder_stream(step, fresh, tokens=7, reset_at=5):
    outs, state = [], fresh()
    for i in range(tokens):
        if i == reset_at:
            state = fresh()
        with torch.no_grad():
            logits, state = step(torch.tensor([[i % 32]]), state)
        outs.append(clone((logits, state)))
    return outs


def _llm_backbone():
    small = dict(layers=1, kv_heads=2, head_dim=8)
    # the registered window (2,000 tokens, K = 2001): excluded, every class refused, nothing
    # prepared (a re-cut example per class would allocate up to the whole window, 2001 times)
    m = TinyDecoder(window=2000)
    c = cadence_fx.compile(m, adapters.get("llm-backbone").with_clocks(**small))
    assert not c.catalog.admissible and c.catalog.size == 2001
    def refuse(*args, **kwargs):
        raise AssertionError("capture_catalog prepared a class of an excluded catalog")

    c.select = refuse
    done = _capture(c, torch.no_grad, torch.tensor([[3]]), m.initial_state())
    assert done == {cls: False for cls in c.catalog.classes} and not c.classes
    assert {r["how"].split(" signature")[0] for r in done.rows} == {"stock: region 'kv' has K = 2001"}
    del c.select
    want = _decoder_stream(m, m.initial_state)
    got = _decoder_stream(c, m.initial_state)
    assert [_same(w, g) for w, g in zip(want, got)] == [True] * len(want)
    k = c.counters
    why = ("region 'kv' has K = 2001 signature classes, over the width limit 64 (Criterion 3.5): "
           "the step runs stock; raise the adapter's `width_limit` to 2001 if that many classes "
           "may be compiled, or leave the stage to an outer scheduler")
    assert (k.calls, k.compiled_calls, k.traces, dict(k.reasons)) == (7, 0, 0, {why: 7})
    # a 4-token window: K = 5, every class compiled ahead of the stream
    m = TinyDecoder(window=4)
    c = cadence_fx.compile(m, adapters.get("llm-backbone").with_clocks(window=4, **small))
    done = _capture(c, torch.no_grad, torch.tensor([[3]]), m.initial_state())
    assert len(done) == 5
    _all_compiled(c, done)
    _stream_checks(c, _decoder_stream(m, m.initial_state), _decoder_stream(c, m.initial_state),
                   classes=5)


def _freeze_omni():
    from cadence_fx.models.freeze_omni import FreezeOmniEncoder
    enc = FreezeOmniEncoder(layers=2, dim=64, heads=2, ffn=128).eval()
    c = cadence_fx.compile(enc, adapters.get("freeze-omni").with_clocks(layers=2, heads=2,
                                                                       head_dim=32))
    g = torch.Generator().manual_seed(1)
    feats = [torch.randn(1, 16, 80, generator=g) for _ in range(6)]
    # state["offset"] is (1,) int64 with call_dim 1: the rank that used to crash the re-cut
    done = _capture(c, torch.inference_mode, feats[0], enc.initial_state())
    _all_compiled(c, done)

    def run(step):
        return stream(step, feats, enc.initial_state, None, reset_at=4, mode=torch.inference_mode)

    _stream_checks(c, run(enc), run(c), classes=2)


# Token2Wav at a CPU size: DiT depth 1, 2 Euler steps, a 30-frame prompt keeping 20 frames, and
# the stock envelopes cut to 3 solver-step slots of 120 frames (the adapter's stock_* clocks)
T2W = dict(n_steps=2, f_prompt=30, f_retained=20, stock_steps=3, stock_frames=120)


def _small_cfm(token2wav):
    cfm = token2wav.build_cfm(depth=1)
    cfm.att_cache_buffer = torch.zeros(T2W["stock_steps"], 16, 2, 8, T2W["stock_frames"], 128)
    cfm.cnn_cache_buffer = torch.zeros(T2W["stock_steps"], 16, 2, 1024, 2)
    cfm.estimator.att_cache_buffer = torch.zeros(16, 2, 8, T2W["stock_frames"], 128)
    return cfm


def _token2wav():
    require(*TOKEN2WAV)
    from cadence_fx.models import token2wav
    token2wav.import_stock()
    return token2wav


def _cfm(name):
    token2wav = _token2wav()
    step = token2wav.CFMStep(_small_cfm(token2wav), prompt_frames=T2W["f_prompt"],
                             retained_frames=T2W["f_retained"], n_timesteps=T2W["n_steps"])
    spks, prompt = token2wav.prime_cfm(step)
    adapter = adapters.get(name).with_clocks(**T2W)
    if name == "minicpmo-token2wav":   # the whole model's adapter: the CFM step holds two regions
        adapter = adapter.select("estimator_att_cache", "estimator_cnn_cache")
    c = cadence_fx.compile(step, adapter)
    g = torch.Generator().manual_seed(3)
    chunks = [(torch.randn(1, 80, w, generator=g), torch.zeros(1, 80, w)) for w in (50, 50, 56, 50)]
    done = _capture(c, torch.inference_mode, chunks[0][0], spks, chunks[0][1], prompt)
    assert len(done) == 4   # extents {30, 50} x widths {50, 56}
    _all_compiled(c, done)

    def run(s):
        return stream(lambda chunk, state: s(chunk[0], spks, chunk[1], state), chunks, prompt,
                      None, reset_at=3, mode=torch.inference_mode)

    _stream_checks(c, run(step), run(c), classes=4)


def _hift():
    token2wav = _token2wav()
    stock = token2wav.import_stock().hifigan
    torch.manual_seed(0)   # HiFT's sizes cut down; its clocks (80 bins, 480 samples a frame) kept
    hift = stock.HiFTGenerator(
        base_channels=32, resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1]],
        source_resblock_kernel_sizes=[3, 3, 3], source_resblock_dilation_sizes=[[1], [1], [1]],
        f0_predictor=stock.ConvRNNF0Predictor(cond_channels=32))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hift.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (0.05 if p.dim() == 1 else 0.0))
    step = token2wav.HiFTStep(hift.eval())
    c = cadence_fx.compile(step, "minicpmo-token2wav-hift")
    mels = [torch.randn(1, 80, w, generator=g) for w in (50, 50, 56, 50, 56)]
    last = [False, False, True, False, True]   # a turn ends with the 56-frame last call
    done = _capture(c, torch.inference_mode, mels[0], token2wav.empty_hift_cache(),
                    last_chunk=False)
    _all_compiled(c, done)
    # last_chunk is a host flag: the catalog's classes were compiled with the example's False;
    # the last call's class is prepared on its own
    full = {"mel": torch.zeros(1, 80, 8), "source": torch.zeros(1, 1, 3840),
            "speech": torch.zeros(1, 3840)}
    with torch.inference_mode():
        assert c.prepare(mels[2], full, last_chunk=True)

    def run(s):
        torch.manual_seed(77)   # HiFT draws device randomness: the same start on both sides
        return stream(lambda call, cache: s(call[0], cache, last_chunk=call[1]),
                      list(zip(mels, last)), token2wav.empty_hift_cache, None, reset_at=3,
                      mode=torch.inference_mode)

    _stream_checks(c, run(step), run(c), classes=5)


def _flow():
    token2wav = _token2wav()
    flow = token2wav.build_flow(1, blocks=(1, 1))
    flow.decoder = _small_cfm(token2wav)
    step = token2wav.FlowStep(flow, prompt_frames=T2W["f_prompt"],
                              retained_frames=T2W["f_retained"], n_timesteps=T2W["n_steps"])
    spk, prompt = token2wav.prime_flow(step)
    adapter = adapters.get("minicpmo-token2wav-flow").with_clocks(conformer_layers=2, **T2W)
    c = cadence_fx.compile(step, adapter)
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 6561, (1, 28), generator=g) for _ in range(4)]
    last = [False, False, True, False]
    done = _capture(c, torch.inference_mode, tokens[0], spk, prompt, last_chunk=False)
    assert len(done) == 2   # extents {30, 50}, 28 tokens a call
    _all_compiled(c, done)
    at_window = dict(prompt)   # both attention caches at the window, 30 + 20 frames
    for key, dim in (("estimator_att_cache", 4), ("conformer_att_cache", 3)):
        shape = list(prompt[key].shape)
        shape[dim] = 50
        at_window[key] = torch.zeros(shape)
    with torch.inference_mode():   # the host flag last_chunk: the last call's class on its own
        assert c.prepare(tokens[2], spk, at_window, last_chunk=True)

    def run(s):
        return stream(lambda call, state: s(call[0], spk, state, last_chunk=call[1]),
                      list(zip(tokens, last)), prompt, None, reset_at=3, mode=torch.inference_mode)

    _stream_checks(c, run(step), run(c), classes=3)


def _moshi_frames(n):
    g = torch.Generator().manual_seed(3)
    return [0.1 * torch.randn(1, 1, 1920, generator=g) for _ in range(n)]


def _moshi_run(c, step, frames, reset_at):
    torch.manual_seed(5)
    outs, state = [], step.initial_state()
    for i, frame in enumerate(frames):
        if i == reset_at:
            state = step.initial_state()
        with torch.no_grad():
            a, b, state = c(frame, state)
        outs.append(clone((a, b)))
    return outs


def _mimi():
    require(*MOSHI)
    from cadence_fx.models import moshi as M
    mimi = M.build_mimi(seed=0)
    frames = _moshi_frames(4)
    want = M.stock_stream(mimi, None, frames, reset_at=3)
    step = M.MimiStep(mimi)
    c = cadence_fx.compile(step, "moshi-mimi")
    done = _capture(c, torch.no_grad, frames[0], step.initial_state())
    _all_compiled(c, done)
    _stream_checks(c, want, _moshi_run(c, step, frames, 3), classes=1)


def _moshi(name):
    require(*MOSHI)
    from cadence_fx.models import moshi as M
    mimi = M.build_mimi(seed=0)
    lm_gen = M.build_lm_gen(seed=1, overrides=M.SMALL_LM, dtype=torch.float32)
    frames = _moshi_frames(5)
    torch.manual_seed(5)
    want = M.stock_stream(mimi, lm_gen, frames, reset_at=4)
    step = M.MoshiStep(mimi, lm_gen)
    lm = M.SMALL_LM   # the LM clocks matched to the 2-layer LM, as moshi_adapter does
    c = cadence_fx.compile(step, adapters.get(name).with_clocks(
        lm_layers=lm["num_layers"], lm_heads=lm["num_heads"],
        lm_head_dim=lm["dim"] // lm["num_heads"]))
    # lm_offset (the LM's host step counter, 0 and 1 while its delays fill, then 2) is part of
    # the signature: one example per value (the states of a stream's first three frames, run
    # eagerly: the stock step decodes the tokens it finds), each compiling the catalog's class
    examples, state = [], step.initial_state()
    for frame in frames[:3]:
        examples.append(clone(state))
        with torch.no_grad():
            state = step(frame, state)[2]
    for offset, example in enumerate(examples):
        assert example["lm_offset"] == offset
        done = _capture(c, torch.no_grad, frames[0], example)
        assert done == {cls: True for cls in c.catalog.classes} and len(c.classes) == offset + 1
    _stream_checks(c, want, _moshi_run(c, step, frames, 4), classes=3)


CASES = {
    "minicpmo-token2wav": lambda: _cfm("minicpmo-token2wav"),
    "minicpmo-token2wav-hift": _hift,
    "minicpmo-token2wav-flow": _flow,
    "minicpmo-token2wav-cfm": lambda: _cfm("minicpmo-token2wav-cfm"),
    "moshi": lambda: _moshi("moshi"),
    "moshi-mimi": _mimi,
    "personaplex": lambda: _moshi("personaplex"),
    "freeze-omni": _freeze_omni,
    "llm-backbone": _llm_backbone,
}
# Measured on the shared 2-core CPU (load ~5): without the slow ones the file takes ~90 s (cfm 40,
# hift 31, toy 5, freeze-omni 5, llm-backbone 1). These build bigger steps -- Mimi at its real size
# (moshi-mimi 53, moshi 94, personaplex 117), the flow with its conformer encoder (52), a second
# CFM (45) -- and are marked slow
SLOW = {"minicpmo-token2wav", "minicpmo-token2wav-flow", "moshi", "moshi-mimi", "personaplex"}


def test_every_registered_adapter_has_a_case():
    assert set(CASES) == set(adapters.names())


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in CASES])
def test_capture_catalog_then_a_stream_on_the_registered_step(name):
    CASES[name]()
