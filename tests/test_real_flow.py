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


def _stream(step, spk, prompt, tokens):
    outs, addresses, state = [], {}, prompt
    for i, tok in enumerate(tokens):
        if i % 3 == 0:
            state = prompt  # turn boundary: restore the prompt state
        with torch.inference_mode():
            mel, state = step(tok, spk, state, last_chunk=LAST[i])
        for k, v in state.items():
            addresses.setdefault(k, set()).add(v.data_ptr())
        outs.append((mel.clone(), {k: v.clone() for k, v in state.items()}))
    return outs, addresses


def test_flow_stream_bit_exact_with_three_carries():
    step = token2wav.FlowStep(token2wav.build_flow(1, blocks=(1, 1)))
    spk, prompt = token2wav.prime_flow(step)
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 6561, (1, 28), generator=g) for _ in LAST]
    stock, stock_addresses = _stream(step, spk, prompt, tokens)
    adapter = adapters.get("minicpmo-token2wav-flow").with_clocks(conformer_layers=2)
    compiled = cadence_fx.compile(step, adapter, verify=True)
    ours, addresses = _stream(compiled, spk, prompt, tokens)
    for (ma, sa), (mb, sb) in zip(stock, ours):
        assert torch.equal(ma, mb)
        assert all(_equal_state(sa[k], sb[k]) for k in sa)
    c = compiled.counters
    assert c.fallbacks == 0 and c.traces == 3 and c.retentions == 4  # both caches, once a turn
    for region in ("estimator_att_cache", "estimator_cnn_cache", "conformer_att_cache"):
        assert len(addresses[region]) == 1, region
    assert len(stock_addresses["conformer_att_cache"]) > 1
    assert not any(e.records["near_misses"] for e in compiled.classes.values())
    assert sum(compiled.auditor.comparisons.values()) == c.applications
