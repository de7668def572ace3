"""The real HiFT vocoder of minicpmo==0.1.2 (stock HiFTGenerator, default configuration, random
weights) inside Token2Wav's streaming vocoder step, compiled and bit-exact on the CPU over a
stream with a turn reset and a 56-frame last call. It draws randomness on every call (SineGen's
rand and randn_like); both sides start from the same generator state."""
import pytest
import torch

import cadence_fx
from op_count import OpCount, difference
from stock_packages import TOKEN2WAV, require

require(*TOKEN2WAV)   # skips only when a third-party package is absent
from cadence_fx.models import token2wav  # noqa: E402 - the project's own: must import

token2wav.import_stock()

TURN = [50, 50, 50, 56]


def _stream(step, mels, device="cpu"):
    torch.manual_seed(77)
    if device != "cpu":
        torch.cuda.manual_seed(77)
    outs, addresses, cache = [], set(), token2wav.empty_hift_cache(device)
    for i, mel in enumerate(mels):
        if i % len(TURN) == 0:
            cache = token2wav.empty_hift_cache(device)  # turn boundary
        with torch.inference_mode():
            pcm, cache = step(mel, cache, last_chunk=(i % len(TURN) == len(TURN) - 1))
        addresses.add(cache["source"].data_ptr())
        outs.append((pcm.clone(), {k: v.clone() for k, v in cache.items()}))
    return outs, addresses


def test_hift_stream_bit_exact_with_device_randomness_and_istft_decomposed():
    """istft's host check on its constant window is made once per class (passes/host_checks.py)
    and the call becomes its aten ops: nothing of the vocoder waits on the host."""
    step = token2wav.HiFTStep(token2wav.build_hift())
    g = torch.Generator().manual_seed(2)
    mels = [torch.randn(1, 80, w, generator=g) for w in TURN * 2]
    stock, stock_addresses = _stream(step, mels)
    compiled = cadence_fx.compile(step, "minicpmo-token2wav-hift", verify=True)
    ours, addresses = _stream(compiled, mels)
    for (pa, ca), (pb, cb) in zip(stock, ours):
        assert torch.equal(pa, pb) and all(torch.equal(ca[k], cb[k]) for k in ca)
    c = compiled.counters
    assert c.fallbacks == 0 and c.compiled_calls == len(mels)
    assert c.traces == 3                        # extents (0,0,0) and (8,3840,3840); widths 50, 56
    assert len(addresses) == 1 and len(stock_addresses) > 1
    reasons = {r for e in compiled.classes.values() for p in e.records.pieces for r in p.reasons}
    assert reasons == {"shadow audit compares on the host"}     # the auditor, on the CPU only
    assert all([w.kind for w in e.records.rewrites].count("host_check") == 1
               for e in compiled.classes.values())
    assert not any(n.target is torch.ops.aten.istft.default
                   for e in compiled.classes.values() for n in e.records.graph.graph.nodes)
    assert sum(compiled.auditor.comparisons.values()) == 3 * len(mels)
    # the mel context, torch.concat then a tail: a window on the carry (torch.concat traces as an
    # op of its own, aten.concat); the source and speech tails are cut from fresh results, not
    # kept by concatenation: copied once, with the reason
    kinds = {(e.key[0][0], w.region): w.kind for e in compiled.classes.values()
             for w in e.records.rewrites}
    assert {k: v for k, v in kinds.items() if k[1] == "hift_mel_cache"} == {
        ((0, 0, 0), "hift_mel_cache"): "retention", ((8, 3840, 3840), "hift_mel_cache"): "retention"}
    assert {v for k, v in kinds.items() if k[1] not in ("hift_mel_cache", None)} == {"materialize"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hift_replays_bit_exact_on_cuda_with_pinned_kernels():
    cadence_fx.pin_deterministic_kernels()  # stock HiFT is not reproducible without it
    step = token2wav.HiFTStep(token2wav.build_hift(device="cuda"))
    g = torch.Generator().manual_seed(2)
    mels = [torch.randn(1, 80, w, generator=g).cuda() for w in TURN * 3]
    stock, _ = _stream(step, mels, "cuda")
    again, _ = _stream(step, mels, "cuda")
    assert all(torch.equal(a[0], b[0]) for a, b in zip(stock, again))  # the pinned envelope
    compiled = cadence_fx.compile(step, "minicpmo-token2wav-hift")
    ours, addresses = _stream(compiled, mels, "cuda")
    for (pa, ca), (pb, cb) in zip(stock, ours):
        assert torch.equal(pa, pb) and all(torch.equal(ca[k], cb[k]) for k in ca)
    c = compiled.counters
    assert c.fallbacks == 0 and c.replays == len(mels)   # the whole call is one graph, istft in it
    assert c.eager_pieces == 0 and len(addresses) == 1
    hoisted = [k for e in compiled.classes.values() for k in e.records.constants
               if k.host_to_device]
    assert hoisted  # the STFT window and the harmonic multipliers are no longer copied per call


def test_a_steady_chunk_launches_no_more_kernels_than_stock():
    """Per steady 50-frame chunk: the aten ops that launch a kernel, compiled against stock from
    the same cache and generator state (the mel context written on the carry in place of stock's
    concat + tail)."""
    step = token2wav.HiFTStep(token2wav.build_hift())
    g = torch.Generator().manual_seed(4)
    mels = [torch.randn(1, 80, 50, generator=g) for _ in range(3)]
    compiled = cadence_fx.compile(step, "minicpmo-token2wav-hift")
    torch.manual_seed(5)
    with torch.inference_mode():
        cache = compiled(mels[1], compiled(mels[0], token2wav.empty_hift_cache("cpu"))[1])[1]
        ref = {k: v.clone() for k, v in cache.items()}
        torch.manual_seed(6)
        with OpCount() as ours:
            pcm, _ = compiled(mels[2], cache)
        torch.manual_seed(6)
        with OpCount() as theirs:
            want, _ = step(mels[2], ref)
    assert torch.equal(pcm, want)
    c = compiled.counters
    assert (c.compiled_calls, c.fallbacks, c.traces) == (3, 0, 2)
    # stock's istft is one op to the dispatcher, but its kernel runs the ops of its decomposition
    # (and the window check on top): counted as those, ours runs no more
    with OpCount() as inner:
        torch._refs.istft(torch.zeros(1, 9, 8, dtype=torch.complex64), 16, 4, 16,
                          window=torch.hann_window(16))
    istfts = theirs.ops[torch.ops.aten.istft.default]
    assert istfts == 1 and ours.ops[torch.ops.aten.istft.default] == 0
    assert ours.total <= theirs.total - istfts + istfts * inner.total, difference(ours, theirs)
    assert ours.ops[torch.ops.aten.concat.default] < theirs.ops[torch.ops.aten.concat.default]


def test_without_the_host_check_pass_istft_stays_an_eager_piece():
    """The ablation: ``Options(host_checks=False)`` keeps the stock call, eager with its reason."""
    from cadence_fx.passes.pipeline import Options
    step = token2wav.HiFTStep(token2wav.build_hift())
    g = torch.Generator().manual_seed(2)
    mels = [torch.randn(1, 80, w, generator=g) for w in TURN]
    stock, _ = _stream(step, mels)
    compiled = cadence_fx.compile(step, "minicpmo-token2wav-hift", options=Options(host_checks=False))
    ours, _ = _stream(compiled, mels)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(stock, ours))
    c = compiled.counters
    assert (c.compiled_calls, c.fallbacks, c.eager_pieces) == (len(mels), 0, len(mels))
    reasons = {r for e in compiled.classes.values() for p in e.records.pieces for r in p.reasons}
    assert "istft checks its window on the host (not capturable)" in reasons
