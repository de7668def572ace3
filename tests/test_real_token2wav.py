"""The real minicpmo==0.1.2 CFM chunk (CausalConditionalCFM.forward_chunk, real DiT configuration at
depth 2, random weights) traced, rewritten and bit-exact over a stream with retention, on the CPU."""
import pytest
import torch

import cadence_fx
from cadence_fx import adapters

token2wav = pytest.importorskip("cadence_fx.models.token2wav")
try:
    token2wav.import_stock()
except ImportError as e:  # pragma: no cover - the CI installs minicpmo and einops
    pytest.skip(str(e), allow_module_level=True)

WIDTHS = [50, 50, 50, 56, 50, 50]   # the 56-frame last call ends turn one; turn two restarts at 302
RESET_AT = 4


def _stream(step, spks, prompt_state, chunks):
    outs, addresses, state = [], set(), prompt_state
    for i, (mu, cond) in enumerate(chunks):
        if i == RESET_AT:
            state = prompt_state
        with torch.inference_mode():
            mel, state = step(mu, spks, cond, state)
        att = state["estimator_att_cache"]
        addresses.add(att.data_ptr())
        outs.append((mel.clone(), att.clone(), state["estimator_cnn_cache"].clone()))
    return outs, addresses


@pytest.fixture(scope="module")
def runs():
    step = token2wav.CFMStep(token2wav.build_cfm(depth=2))
    spks, prompt_state = token2wav.prime_cfm(step)
    before = {k: v.clone() for k, v in prompt_state.items()}
    g = torch.Generator().manual_seed(3)
    chunks = [(torch.randn(1, 80, w, generator=g), torch.zeros(1, 80, w)) for w in WIDTHS]
    stock = _stream(step, spks, prompt_state, chunks)
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
    compiled = cadence_fx.compile(step, adapter, verify=True)
    result = _stream(compiled, spks, prompt_state, chunks)
    return stock, result, compiled, prompt_state, before


def test_mel_is_bit_exact_every_chunk(runs):
    (stock, _), (ours, _), *_ = runs
    assert [torch.equal(a[0], b[0]) for a, b in zip(stock, ours)] == [True] * len(WIDTHS)


def test_state_is_bit_exact_on_the_declared_extent(runs):
    (stock, _), (ours, _), *_ = runs
    for (_, att_s, cnn_s), (_, att_c, cnn_c) in zip(stock, ours):
        assert att_c.shape[0] == 10 and att_s.shape[0] == 16  # 10 solver steps declared, 16 reserved
        assert torch.equal(att_s[:10], att_c)
        assert not att_s[10:].any()  # the stock rows the carry drops are never written
        assert cnn_c.shape[0] == 10 and torch.equal(cnn_s[:10], cnn_c) and not cnn_s[10:].any()


def test_carry_keeps_one_address_and_the_declared_size(runs):
    (_, stock_addresses), (_, addresses), compiled, *_ = runs
    assert len(addresses) == 1 and len(stock_addresses) > 1
    carry = compiled.carries["estimator_att_cache"].tensor
    assert tuple(carry.shape) == (10, 16, 2, 8, 458, 128)
    assert tuple(compiled.carries["estimator_cnn_cache"].tensor.shape) == (10, 16, 2, 1024, 2)
    assert compiled.counters.carry_addresses == 1


def test_counters_and_audit(runs):
    compiled = runs[2]
    c = compiled.counters
    assert c.fallbacks == 0 and c.compiled_calls == len(WIDTHS)
    assert c.traces == 4                  # (302, 50), (352, 50), (402, 50), (402, 56)
    assert c.retentions == 2              # calls entering at 402 frames
    assert c.absorptions == 4             # the prompt state of both regions, once per turn
    assert sum(compiled.auditor.comparisons.values()) == c.retentions
    kinds = {w["kind"] for e in compiled.classes.values() for w in e.records["rewrites"]}
    assert {"envelope", "retention", "in_place"} <= kinds


def test_prompt_state_is_copy_on_write(runs):
    *_, prompt_state, before = runs
    assert all(torch.equal(prompt_state[k], before[k]) for k in before)
