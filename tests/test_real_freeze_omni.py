"""The Freeze-Omni streaming encoder (conv subsampling + chunked attention, one left chunk):
compiled and bit-exact against its eager step over a stream with a turn reset, with the
attention cache's two extents {0, 4} as the two classes (K = 2). 4 layers of width 256 here to
fit CI (the demo and the H200 run use 24 x 1024)."""
import torch

import cadence_fx
from cadence_fx import adapters
from cadence_fx.passes.fx_utils import aten
from cadence_fx.models.freeze_omni import FreezeOmniEncoder
from op_count import OpCount, difference
from helpers import same


def _stream(step, enc, feats, reset_at):
    outs, state, addresses = [], enc.initial_state(), set()
    for i, f in enumerate(feats):
        if i == reset_at:
            state = enc.initial_state()
        with torch.inference_mode():
            y, state = step(f, state)
        addresses.add(state["att_cache"].data_ptr())
        outs.append((y.clone(), {k: v.clone() for k, v in state.items()}))
    return outs, addresses


def test_freeze_omni_stream_bit_exact_with_k_2():
    enc = FreezeOmniEncoder(layers=4, dim=256, heads=4, ffn=1024).eval()
    adapter = adapters.get("freeze-omni").with_clocks(layers=4, heads=4, head_dim=64)
    g = torch.Generator().manual_seed(1)
    feats = [torch.randn(1, 16, 80, generator=g) for _ in range(10)]
    stock, stock_addresses = _stream(enc, enc, feats, reset_at=5)
    compiled = cadence_fx.compile(enc, adapter, verify=True)
    ours, addresses = _stream(compiled, enc, feats, reset_at=5)
    assert [same(s, o) for s, o in zip(stock, ours)] == [True] * 10
    assert len(addresses) == 1 and len(stock_addresses) > 1  # cat + slice vs one carry
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks, k.traces) == (10, 0, 2)
    assert sorted(e.key[0][0] for e in compiled.classes.values()) == [(0, 3), (4, 3)]
    assert sum(compiled.auditor.comparisons.values()) > 0  # the shadow auditor checked the writes
    # the stacked per-layer K/V windows and the fbank context: in place, no copy of the state
    kinds = {(e.key[0][0], w.region): w.kind for e in compiled.classes.values()
             for w in e.records.rewrites}
    assert kinds == {((0, 3), "att_cache"): "append", ((0, 3), "conv_left"): "retention",
                     ((4, 3), "att_cache"): "retention", ((4, 3), "conv_left"): "retention"}
    assert k.retentions == 10 + 8   # conv_left every call; att_cache but at the turns' first calls


def test_freeze_omni_catalog_is_two_classes():
    cat = cadence_fx.catalog.build_catalog(adapters.get("freeze-omni"))
    assert tuple(cat.region("att_cache").extents) == (0, 4) and cat.region("att_cache").K == 2


def test_a_steady_chunk_launches_no_more_kernels_than_stock():
    """Per steady chunk (the attention cache at its window): the aten ops that launch a kernel,
    compiled against stock from the same state. The stacked K/V and the conv context are written
    on the carry in place of stock's cat + stack + slice."""
    enc = FreezeOmniEncoder(layers=4, dim=256, heads=4, ffn=1024).eval()
    adapter = adapters.get("freeze-omni").with_clocks(layers=4, heads=4, head_dim=64)
    g = torch.Generator().manual_seed(3)
    feats = [torch.randn(1, 16, 80, generator=g) for _ in range(3)]
    compiled = cadence_fx.compile(enc, adapter)
    with torch.no_grad():
        state = compiled(feats[1], compiled(feats[0], enc.initial_state())[1])[1]
        ref = {k: v.clone() for k, v in state.items()}
        with OpCount() as ours:
            y, _ = compiled(feats[2], state)
        with OpCount() as theirs:
            want, _ = enc(feats[2], ref)
    assert torch.equal(y, want)
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks, k.traces) == (3, 0, 2)
    assert ours.total <= theirs.total, difference(ours, theirs)
    assert ours.ops[aten.stack.default] == 0 < theirs.ops[aten.stack.default]
