"""``release_envelopes=True`` on the real CFM chunk (DiT depth 2): the stock (16, 16, 2, 8, 1000,
128) envelope is freed once the carries replace it, every class still compiles (the carry pass
reads the envelope's undeclared rows while it is given back), the stream stays bit-exact."""
import torch

import cadence_fx
from cadence_fx import adapters
from stock_packages import TOKEN2WAV, require

require(*TOKEN2WAV)   # skips only when a third-party package is absent
from cadence_fx.models import token2wav  # noqa: E402 - the project's own: must import

token2wav.import_stock()

WIDTHS = [50, 50, 50, 56, 50, 50]
RESET_AT = 4


def _stream(step, spks, prompt, chunks):
    mels, state = [], prompt
    for i, (mu, cond) in enumerate(chunks):
        if i == RESET_AT:
            state = prompt
        with torch.inference_mode():
            mel, state = step(mu, spks, cond, state)
        mels.append(mel.clone())
    return mels


def test_release_envelopes_on_the_real_cfm():
    g = torch.Generator().manual_seed(3)
    chunks = [(torch.randn(1, 80, w, generator=g), torch.zeros(1, 80, w)) for w in WIDTHS]
    stock = token2wav.CFMStep(token2wav.build_cfm(depth=2))
    spks, prompt = token2wav.prime_cfm(stock)
    ref = _stream(stock, spks, prompt, chunks)
    del stock
    step = token2wav.CFMStep(token2wav.build_cfm(depth=2))
    envelope = step.cfm.att_cache_buffer if hasattr(step.cfm, "att_cache_buffer") else None
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
    compiled = cadence_fx.compile(step, adapter, release_envelopes=True)
    got = _stream(compiled, spks, prompt, chunks)
    assert [torch.equal(a, b) for a, b in zip(ref, got)] == [True] * len(WIDTHS)
    k = compiled.counters
    assert (k.fallbacks, k.traces, k.compiled_calls) == (0, 4, len(WIDTHS))
    assert k.released_bytes >= 16 * 16 * 2 * 8 * 1000 * 128 * 4   # the 2.1 GB envelope
    if envelope is not None:
        assert envelope.untyped_storage().nbytes() == 0
    compiled.close()   # the module gets its buffers back, zero-filled
    assert all(b.untyped_storage().nbytes() > 0 for b in step.buffers())
