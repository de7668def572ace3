"""The real minicpmo==0.1.2 CFM chunk (CausalConditionalCFM.forward_chunk, real DiT configuration at
depth 2, random weights) traced, rewritten and bit-exact over a stream with retention, on the CPU."""
import pytest
import torch

import cadence_fx
from cadence_fx import adapters
from stock_packages import TOKEN2WAV, require

require(*TOKEN2WAV)   # skips only when a third-party package is absent
from cadence_fx.models import token2wav  # noqa: E402 - the project's own: must import

token2wav.import_stock()

WIDTHS = [50, 50, 50, 56, 50, 50]   # the 56-frame last call ends turn one; turn two restarts at 302
RESET_AT = 4



def _lockstep(stock, compiled, spks, prompt_state, chunks):
    """Stock and compiled side by side, compared at every chunk (the stock state alone is
    0.8 GB per chunk, so only the verdicts and addresses are kept)."""
    verdicts, addresses = [], {"stock": set(), "ours": set()}
    state_s = state_c = prompt_state
    for i, (mu, cond) in enumerate(chunks):
        if i == RESET_AT:
            state_s = state_c = prompt_state
        with torch.inference_mode():
            mel_s, state_s = stock(mu, spks, cond, state_s)
            mel_c, state_c = compiled(mu, spks, cond, state_c)
        att_s, att_c = state_s["estimator_att_cache"], state_c["estimator_att_cache"]
        cnn_s, cnn_c = state_s["estimator_cnn_cache"], state_c["estimator_cnn_cache"]
        addresses["stock"].add(att_s.data_ptr())
        addresses["ours"].add(att_c.data_ptr())
        verdicts.append({
            "mel": torch.equal(mel_s, mel_c),
            "shapes": (att_s.shape[0], att_c.shape[0], cnn_s.shape[0], cnn_c.shape[0]),
            "att": torch.equal(att_s[:10], att_c) and not att_s[10:].any(),
            "cnn": torch.equal(cnn_s[:10], cnn_c) and not cnn_s[10:].any()})
    return verdicts, addresses


@pytest.fixture(scope="module")
def runs():
    step = token2wav.CFMStep(token2wav.build_cfm(depth=2))
    spks, prompt_state = token2wav.prime_cfm(step)
    before = {k: v.clone() for k, v in prompt_state.items()}
    g = torch.Generator().manual_seed(3)
    chunks = [(torch.randn(1, 80, w, generator=g), torch.zeros(1, 80, w)) for w in WIDTHS]
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
    compiled = cadence_fx.compile(step, adapter, verify=True)
    verdicts, addresses = _lockstep(step, compiled, spks, prompt_state, chunks)
    return verdicts, addresses, compiled, prompt_state, before


def test_mel_is_bit_exact_every_chunk(runs):
    assert [v["mel"] for v in runs[0]] == [True] * len(WIDTHS)


def test_state_is_bit_exact_on_the_declared_extent(runs):
    for v in runs[0]:
        assert v["shapes"] == (16, 10, 16, 10)  # 10 solver steps declared, 16 slots reserved
        assert v["att"] and v["cnn"]            # equal where declared; stock's extra rows zero


def test_carry_keeps_one_address_and_the_declared_size(runs):
    addresses, compiled = runs[1], runs[2]
    assert len(addresses["ours"]) == 1 and len(addresses["stock"]) > 1
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
    kinds = {w.kind for e in compiled.classes.values() for w in e.records.rewrites}
    assert {"envelope", "retention", "in_place"} <= kinds


def test_prompt_state_is_copy_on_write(runs):
    *_, prompt_state, before = runs
    assert all(torch.equal(prompt_state[k], before[k]) for k in before)
