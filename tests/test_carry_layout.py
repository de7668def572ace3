"""Carry layouts (``cadence_fx/layouts.py``, ``passes/_carry_layout.py``): a state stock returns in
another layout than its carry is never handed out as a carry view of another layout, and a state
arriving in another layout than its carry never reaches a class that reads it in a way whose bits
depend on the layout.

The vehicle is ``tests/streaming_prompt_decoder.py`` with its prosody history ``hist`` left
transposed (the model there makes it contiguous): each call reduces it over frames
(``hist.mean(2)``), which gives other bits on a transposed tensor than on a contiguous one.
``transposed-priming`` returns it transposed from the priming pass only (each later call joins it
with a ``cat``, contiguous); ``transposed`` keeps it transposed on every call. Streams of two
speakers, a turn reset and partial last chunks are compared with stock, output and state, with
``torch.equal``."""
import pytest
import torch

import cadence_fx
import streaming_prompt_decoder as spd
from cadence_fx.audit import Auditor
from cadence_fx.errors import GuardError, ShadowMismatch
from streaming_prompt_decoder import CHUNK, LAYERS, PROMPT, RETAINED, prompt_adapter, serve

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]
MEAN = "aten.mean.dim"


class TransposedHistory(spd.PromptDecoder):
    """The prompt decoder with ``hist`` returned transposed from the priming pass
    (``transposed-priming``), or kept transposed on every call (``transposed``)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form

    def history(self, h, state):
        hist = self.to_hist(h).transpose(1, 2)
        hist = spd._join(self.order, state["hist"] if state is not None else None, hist)
        if self.form == "transposed":
            hist = hist.transpose(1, 2).contiguous().transpose(1, 2)
        return hist


def _stream(form, device, **options):
    stock = serve(TransposedHistory(form).to(device).eval(), device)
    compiled = cadence_fx.compile(TransposedHistory(form).to(device).eval(), prompt_adapter(),
                                  **options)
    ours = serve(compiled, device)
    assert len(ours) == len(stock) == 24
    for i, ((y, s), (y0, s0)) in enumerate(zip(ours, stock)):
        assert torch.equal(y, y0), i
        assert all(torch.equal(s[k], s0[k]) for k in s0), (i, [k for k in s0 if not torch.equal(s[k], s0[k])])
        assert s["hist"].stride() == s0["hist"].stride(), i   # the layout too, not only the values
    return compiled


def _classes(compiled, hist_frames, width):
    key = ((PROMPT + RETAINED,) * (2 * LAYERS) + (2,) * LAYERS + (hist_frames,), width)
    return [e for k, e in compiled.classes.items() if k[0] == key]


def _priming(compiled):
    (entry,) = [e for k, e in compiled.classes.items() if k[0][0] == (None,) * (3 * LAYERS + 1)]
    return entry


@pytest.mark.parametrize("device", DEVICES)
def test_a_history_transposed_by_the_priming_pass_stays_exact(device):
    """The priming class hands ``hist`` back transposed, as stock does, not as its contiguous
    carry; the chunk after each priming reads it with a mean, so it runs stock, with the reason;
    every later chunk arrives contiguous and is compiled, the caches written in place."""
    compiled = _stream("transposed-priming", device, verify=True)
    k = compiled.counters
    assert (k.calls, k.compiled_calls, k.fallbacks) == (26, 23, 3)
    (reason,) = k.reasons
    assert reason.startswith("region 'hist' arrives with strides (192, 1, 16)") and MEAN in reason
    assert "(512, 32, 1)" in reason and "`.contiguous()`" in reason   # the carry's strides, the fix
    (miss,) = [m for m in _priming(compiled).records.near_misses if m.region == "hist"]
    assert "dims outermost first (2, 1)" in miss.detail and "not written into the carry" in miss.detail
    (full,) = _classes(compiled, PROMPT + RETAINED, CHUNK)
    kinds = {w.region: w.kind for w in full.records.rewrites}
    assert kinds["hist"] == "retention" and kinds["k0"] == "retention"
    assert full.records.layout_reads == {"hist": MEAN}
    assert compiled.auditor.comparisons["hist"] == 21   # every compiled chunk's write
    if device == "cuda":
        assert k.replays >= 21


@pytest.mark.parametrize("device", DEVICES)
def test_a_history_kept_transposed_runs_stock_with_the_reason(device):
    """Kept transposed, ``hist`` can never be read from the contiguous carry: the primings are
    compiled (the history handed back as stock computes it), every chunk runs stock, each time
    with the reason naming the region, both layouts and the fix; strict mode raises it."""
    compiled = _stream("transposed", device)
    k = compiled.counters
    assert (k.calls, k.compiled_calls, k.fallbacks) == (26, 2, 24)
    assert all(r.startswith("region 'hist' arrives with strides") and MEAN in r for r in k.reasons)
    strict = cadence_fx.compile(TransposedHistory("transposed").to(device).eval(),
                                prompt_adapter(), strict=True)
    with pytest.raises(GuardError, match=r"region 'hist' arrives with strides \(192, 1, 16\)"):
        serve(strict, device)


def test_the_audit_compares_layouts_as_well_as_bits():
    """The same bits in another stride order is a mismatch: the next call's reads may differ."""
    auditor = Auditor()
    stock = torch.randn(1, 12, 16).transpose(1, 2)
    auditor.check("hist", "retention", stock, stock.clone())   # equal, in the same order
    carry = torch.zeros(1, 16, 20)[:, :, :12]
    carry.copy_(stock)
    with pytest.raises(ShadowMismatch, match=r"region 'hist' has the stock bits but not its layout"):
        auditor.check("hist", "retention", stock, carry)
    assert auditor.comparisons["hist"] == 2


def test_a_state_read_only_by_joins_may_arrive_in_any_layout():
    """Near miss that must not fire: the K/V caches are read only by their ``cat``, so a raw
    priming state (a transposed view of the fused projection, not cloned) is copied into the
    contiguous carries and the chunk is compiled."""
    model = spd.make_decoder()
    compiled = cadence_fx.compile(spd.make_decoder(), prompt_adapter())
    tokens = torch.randint(0, spd.VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    chunk = torch.randint(0, spd.VOCAB, (1, CHUNK), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, primed = model(tokens, None)
        assert primed["k0"].stride() == (1728, 12, 144, 1)
        want, state = model(chunk, primed)
        got, ours = compiled(chunk, primed)
    assert torch.equal(got, want) and all(torch.equal(ours[k], state[k]) for k in state)
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks) == (1, 0)
    (entry,) = compiled.classes.values()
    assert entry.records.layout_reads == {"hist": MEAN}   # not the caches
