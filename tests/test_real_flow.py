"""The real Token2Wav flow of minicpmo==0.1.2 -- CausalMaskedDiffWithXvec.inference_chunk:
UpsampleConformerEncoderV2 + CausalConditionalCFM -- with Token2wav.stream's retention of both
attention caches, compiled and bit-exact on the CPU. To fit CI the encoder keeps 1 + 1 of its
6 + 4 blocks and the DiT 1 of its 16; widths, heads and the stream protocol are the real ones."""
import pytest
import torch

import cadence_fx
from cadence_fx import adapters
from stock_packages import TOKEN2WAV, require

require(*TOKEN2WAV)   # skips only when a third-party package is absent
from cadence_fx.models import token2wav  # noqa: E402 - the project's own: must import

token2wav.import_stock()

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
    assert (c.compiled_calls, c.fallbacks) == (len(LAST), 0)
    assert c.traces == 3 and c.retentions == 4  # both caches, once a turn
    for region in ("estimator_att_cache", "estimator_cnn_cache", "conformer_att_cache"):
        assert len(addresses["ours"][region]) == 1, region
    assert len(addresses["stock"]["conformer_att_cache"]) > 1
    assert not any(e.records.near_misses for e in compiled.classes.values())
    assert sum(compiled.auditor.comparisons.values()) == c.applications


def test_a_new_speaker_primes_the_compiled_flow_and_the_envelopes_stay_released():
    """A server primes every new speaker with the flow's own ``setup_cache`` on the module it
    compiled with ``release_envelopes=True``: the declared priming method borrows the envelopes
    (zero-filled) and they are released again; its prompt state equals stock's bit for bit, and
    that speaker's next chunk runs compiled. Any other stock method that reads a released
    envelope says what to do instead of failing on empty storage."""
    from cadence_fx.errors import ContractError
    stock = token2wav.FlowStep(token2wav.build_flow(1, blocks=(1, 1)))
    step = token2wav.FlowStep(token2wav.build_flow(1, blocks=(1, 1)))
    adapter = adapters.get("minicpmo-token2wav-flow").with_clocks(conformer_layers=2)
    compiled = cadence_fx.compile(step, adapter, release_envelopes=True)
    spk_a, prompt_a = token2wav.prime_flow(stock, seed=1)
    tok = torch.randint(0, 6561, (1, 28), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        compiled(tok, spk_a, prompt_a)
    k = compiled.counters
    released = k.released_bytes
    assert released >= 16 * 16 * 2 * 8 * 1000 * 128 * 4 and k.compiled_calls == 1
    spk_b, prompt_b = token2wav.prime_flow(step, seed=2)          # on the compiled module
    spk_ref, prompt_ref = token2wav.prime_flow(stock, seed=2)
    assert all(torch.equal(prompt_b[name], prompt_ref[name]) for name in prompt_ref)
    assert k.primes_lent == 1 and k.released_bytes == released and k.restored_bytes == 0
    with torch.inference_mode():
        mel_c, _ = compiled(tok, spk_b, prompt_b)
        mel_s, _ = stock(tok, spk_ref, prompt_ref)
    assert torch.equal(mel_c, mel_s) and (k.compiled_calls, k.fallbacks) == (2, 0)
    with pytest.raises(ContractError, match="att_cache_buffer.*released"):
        step.flow.decoder.forward_chunk(None)
    assert len(list(step.parameters())) and step.state_dict() and step.eval() is step  # nn.Module's own
