"""The real Token2Wav flow of minicpmo==0.1.2 -- CausalMaskedDiffWithXvec.inference_chunk:
UpsampleConformerEncoderV2 + CausalConditionalCFM -- with Token2wav.stream's retention of both
attention caches, compiled and bit-exact on the CPU. To fit CI the encoder keeps 1 + 1 of its
6 + 4 blocks and the DiT 1 of its 16; widths, heads and the stream protocol are the real ones."""
import pytest
import torch

import cadence_fx
from cadence_fx import adapters

token2wav = pytest.importorskip("cadence_fx.models.token2wav")
try:
    token2wav.import_stock()
except ImportError as e:  # pragma: no cover
    pytest.skip(str(e), allow_module_level=True)

LAST = [False, False, True] * 2   # two turns of three calls; each turn ends with last_chunk


def _equal_state(stock, ours):
    if stock.shape == ours.shape:
        return torch.equal(stock, ours)
    cut = tuple(slice(0, s) for s in ours.shape)  # undeclared stock rows must be zero
    return torch.equal(stock[cut], ours) and stock.count_nonzero() == stock[cut].count_nonzero()


def _lockstep(stock, compiled, spk, prompt, tokens):
    """Stock and compiled side by side, compared chunk by chunk (states are large)."""
    verdicts, addresses = [], {"stock": {}, "ours": {}}
    state_s = state_c = prompt
    for i, tok in enumerate(tokens):
        if i % 3 == 0:
            state_s = state_c = prompt  # turn boundary: restore the prompt state
        with torch.inference_mode():
            mel_s, state_s = stock(tok, spk, state_s, last_chunk=LAST[i])
            mel_c, state_c = compiled(tok, spk, state_c, last_chunk=LAST[i])
        for side, state in (("stock", state_s), ("ours", state_c)):
            for k, v in state.items():
                addresses[side].setdefault(k, set()).add(v.data_ptr())
        verdicts.append(torch.equal(mel_s, mel_c)
                        and all(_equal_state(state_s[k], state_c[k]) for k in state_s))
    return verdicts, addresses


def test_flow_stream_bit_exact_with_three_carries():
    step = token2wav.FlowStep(token2wav.build_flow(1, blocks=(1, 1)))
    spk, prompt = token2wav.prime_flow(step)
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 6561, (1, 28), generator=g) for _ in LAST]
    adapter = adapters.get("minicpmo-token2wav-flow").with_clocks(conformer_layers=2)
    compiled = cadence_fx.compile(step, adapter, verify=True)
    verdicts, addresses = _lockstep(step, compiled, spk, prompt, tokens)
    assert verdicts == [True] * len(LAST)
    c = compiled.counters
    assert c.fallbacks == 0 and c.traces == 3 and c.retentions == 4  # both caches, once a turn
    for region in ("estimator_att_cache", "estimator_cnn_cache", "conformer_att_cache"):
        assert len(addresses["ours"][region]) == 1, region
    assert len(addresses["stock"]["conformer_att_cache"]) > 1
    assert not any(e.records["near_misses"] for e in compiled.classes.values())
    assert sum(compiled.auditor.comparisons.values()) == c.applications
