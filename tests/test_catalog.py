"""The catalog derived from each registered adapter: extents, catalog width K (eq. 7), prices (eq. 2).

Every number here comes from the declarations alone; no model runs.
"""
import dataclasses
import math

import pytest
from hypothesis import given, settings, strategies as st

from cadence_fx import adapters
from cadence_fx.catalog import build_catalog
from cadence_fx.contract import APPEND, Adapter, PromptRetained, Region, Ring, SlidingWindow


def _catalog(name):
    return build_catalog(adapters.get(name))


def _eq7(rc):
    """Eq. (7): K = ceil((A - A-) / s) + 1; the ceiling covers a last step cut short by retention."""
    return math.ceil((rc.bound - rc.lower) / rc.stride) + 1


# -- Token2Wav: the paper's operating point ---------------------------------------------------------

def test_token2wav_estimator_extents_and_width():
    rc = _catalog("minicpmo-token2wav").region("estimator_att_cache")
    assert rc.extents == (302, 352, 402)
    assert (rc.lower, rc.bound, rc.stride) == (302, 402, 50)
    assert rc.K == 3
    assert rc.admissible


def test_token2wav_estimator_prices():
    rc = _catalog("minicpmo-token2wav").region("estimator_att_cache")
    # stock envelope (16, 16, 2, 8, 1000, 128) fp32 against the declared (10, 16, 2, 8, 458, 128) fp32:
    # 458 = retention bound 402 + one 56-frame call of room for the pre-retention write
    assert rc.stock_bytes == 16 * 16 * 2 * 8 * 1000 * 128 * 4 == 2_097_152_000
    assert rc.declared_extent == 458
    assert rc.declared_bytes == 10 * 16 * 2 * 8 * 458 * 128 * 4 == 600_309_760
    assert rc.rho > 3


def test_token2wav_catalog_admissible():
    cat = _catalog("minicpmo-token2wav")
    assert cat.admissible
    assert cat.call_widths == (50, 56)


# -- the other families ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["moshi", "personaplex"])
def test_moshi_rings_have_width_one(name):
    cat = _catalog(name)
    assert cat.adapter == name
    for region in ("lm_kv", "mimi_encoder_kv", "mimi_decoder_kv", "lm_token_ring"):
        rc = cat.region(region)
        assert rc.K == 1 and rc.admissible, region
    lm = cat.region("lm_kv")
    assert lm.extents == (3000,)
    assert lm.stock_bytes == lm.declared_bytes == 32 * 2 * 1 * 32 * 3000 * 128 * 2  # bf16, rho = 1
    assert cat.region("mimi_encoder_kv").extents == (250,)
    assert cat.call_widths == (1920,)
    assert cat.size == 1


def test_freeze_omni_attention_width_two():
    cat = _catalog("freeze-omni")
    att = cat.region("att_cache")
    assert att.extents == (0, 4)
    assert att.K == 2 and att.admissible
    assert cat.region("conv_left").K == 1
    assert cat.admissible


def test_llm_backbone_excluded_by_width():
    adapter = adapters.get("llm-backbone")
    cat = build_catalog(adapter)
    kv = cat.region("kv")
    assert kv.K == 2001 > adapter.width_limit == 64
    assert kv.extents == tuple(range(2001))
    assert not kv.admissible
    assert not cat.admissible


@pytest.mark.parametrize("name", adapters.names())
def test_every_region_obeys_eq7(name):
    cat = _catalog(name)
    assert cat.regions, name
    for rc in cat.regions:
        assert rc.K == len(rc.extents) == _eq7(rc), (name, rc.name)
        assert rc.admissible == (rc.K <= adapters.get(name).width_limit)


@pytest.mark.parametrize("name", adapters.names())
def test_as_dict_carries_the_analyze_fields(name):
    d = _catalog(name).as_dict()
    assert d["adapter"] == name and d["catalog_size"] >= 1
    for r in d["regions"]:
        assert {"name", "extents", "K", "admissible", "stock_bytes", "declared_bytes"} <= set(r)


# -- property: any retention clocks ---------------------------------------------------------------

_SIZE = st.integers(min_value=1, max_value=120)


@st.composite
def _regions(draw, index):
    """One region with a random retention policy; returns (region, its clocks, expected [A-, A])."""
    kind = draw(st.sampled_from(["prompt", "window", "ring"]))
    s = draw(_SIZE)
    c = {f"s{index}": s}
    if kind == "prompt":
        p, keep = draw(st.integers(0, 300)), draw(_SIZE)
        c.update({f"p{index}": p, f"keep{index}": keep})
        pol, lower, bound = PromptRetained(f"p{index}", f"keep{index}"), p, p + keep
    elif kind == "window":
        w = draw(_SIZE)
        start = draw(st.one_of(st.none(), st.integers(0, w)))
        c[f"w{index}"] = w
        if start is not None:
            c[f"start{index}"] = start
        pol = SlidingWindow(f"w{index}", None if start is None else f"start{index}")
        lower, bound = (start or 0), w
    else:
        w = draw(_SIZE)
        c[f"w{index}"] = w
        pol, lower, bound = Ring(f"w{index}"), w, w
    region = Region(name=f"r{index}", input=f"state.r{index}", output=f"1.r{index}", dim=1,
                    retention=pol, advance=f"s{index}", ordering=APPEND, shape=("batch", None))
    return region, c, (lower, bound)


@st.composite
def _adapters(draw):
    drawn = [draw(_regions(i)) for i in range(draw(st.integers(1, 3)))]
    clocks = {"batch": 1}
    for _, c, _ in drawn:
        clocks.update(c)
    adapter = Adapter(name="random", clocks=clocks, regions=tuple(r for r, _, _ in drawn))
    return adapter, [b for _, _, b in drawn]


@settings(max_examples=200, deadline=None)
@given(_adapters())
def test_extents_follow_retention(case):
    adapter, bounds = case
    cat = build_catalog(adapter)
    for i, (rc, (lower, bound)) in enumerate(zip(cat.regions, bounds)):
        assert (rc.lower, rc.bound) == (lower, bound)
        assert all(lower <= e <= bound for e in rc.extents)
        assert list(rc.extents) == sorted(set(rc.extents))  # strictly increasing
        assert rc.extents[0] == lower and rc.extents[-1] == bound
        assert rc.K == len(rc.extents) == _eq7(rc)
        # call by call (joint classes in walk order): strictly increasing up to the bound, then constant
        seq = [extents[i] for extents, width in cat.classes if width == cat.call_widths[0]]
        top = seq.index(bound)
        assert all(a < b for a, b in zip(seq[:top], seq[1:top + 1]))
        assert all(e == bound for e in seq[top:])
    assert cat.size == max(rc.K for rc in cat.regions) * len(cat.call_widths)


# -- room: the most frames one call adds -----------------------------------------------------------

def _room_adapter(retention, *, room=None, envelope=None, widths=(4, 6, 8), admission=None,
                  advance="s"):
    clocks = {"W": 6, "P": 4, "R": 6, "s": 2, "c4": 4, "c6": 6, "c8": 8, "flush": 10, "one": 1}
    region = Region(name="k", input="k", output="1", dim=1, retention=retention, advance=advance,
                    shape=(2, None), room=room, envelope=envelope, stock_shape=(2, 64))
    return Adapter(name="room", clocks=clocks, regions=(region,),
                   call_frames=tuple(f"c{w}" for w in widths), call_input="x", call_dim=1,
                   admission=admission)


def test_default_room_is_the_widest_call_the_adapter_admits():
    """Call widths 4, 6 and 8 at an advance of 2 (their gcd): one call appends up to 8 frames,
    so the window's carry holds 6 + 8, not 6 + 2; an admission clock wider than every call
    widens it again."""
    rc = build_catalog(_room_adapter(SlidingWindow("W"))).region("k")
    assert (rc.bound, rc.room, rc.declared_extent) == (6, 8, 14)
    rc = build_catalog(_room_adapter(SlidingWindow("W"), admission="flush")).region("k")
    assert (rc.room, rc.declared_extent) == (10, 16)
    # an advance that is a call clock counts the call's frames too
    rc = build_catalog(_room_adapter(SlidingWindow("W"), advance="c4")).region("k")
    assert rc.room == 8


def test_a_declared_room_wins_and_other_units_keep_the_advance():
    assert build_catalog(_room_adapter(SlidingWindow("W"), room="one")).region("k").room == 1
    # an advance of 3 frames for calls of 4, 6, 8: the widths count other units (fbank frames
    # against encoder frames, tokens against mel frames), so the room is one advance
    adapter = _room_adapter(SlidingWindow("W"))
    adapter = dataclasses.replace(adapter, clocks={**adapter.clocks, "s": 3})
    assert build_catalog(adapter).region("k").room == 3
    # the registered adapters: Freeze-Omni's attention (encoder frames, calls in fbank frames),
    # HiFT's sample caches (calls in mel frames), Token2Wav's declared f_call
    assert build_catalog(adapters.get("freeze-omni")).region("att_cache").room == 4
    assert build_catalog(adapters.get("freeze-omni")).region("conv_left").room == 16
    t2w = build_catalog(adapters.get("minicpmo-token2wav"))
    assert t2w.region("hift_source_cache").room == 3840
    assert t2w.region("hift_mel_cache").room == 56 == t2w.region("estimator_att_cache").room


def test_room_is_honoured_on_a_prompt_retained_region():
    """Declared on a prompt-retained region without an envelope, the room is in the carry (it
    was dropped); without a declaration such a region has none; with an envelope it has the
    widest call by default."""
    plain = build_catalog(_room_adapter(PromptRetained("P", "R"))).region("k")
    assert (plain.bound, plain.room, plain.declared_extent) == (10, 0, 10)
    roomy = build_catalog(_room_adapter(PromptRetained("P", "R"), room="c6")).region("k")
    assert (roomy.room, roomy.declared_extent, roomy.declared_bytes) == (6, 16, 2 * 16 * 4)
    env = build_catalog(_room_adapter(PromptRetained("P", "R"), envelope="buf")).region("k")
    assert env.room == 8


def test_room_on_a_ring_is_refused_with_the_fix():
    from cadence_fx.errors import ContractError
    with pytest.raises(ContractError, match=r"region 'k'.*Ring is written in place at its window "
                                            r"'W' and holds no room; remove `room`"):
        _room_adapter(Ring("W"), room="one").validate()
    assert build_catalog(_room_adapter(Ring("W"))).region("k").room == 0


@pytest.mark.parametrize("name", adapters.names())
def test_no_literal_where_the_adapter_has_a_clock(name):
    """A size written as a literal in ``shape`` or ``stock_shape`` where the other names a clock
    of that value (Token2Wav's envelope had the DiT depth as 16 beside ``dit_depth``): changing
    the clock would leave the literal behind."""
    adapter = adapters.get(name)
    for r in adapter.regions:
        if r.stock_shape is None:
            continue
        for i, (d, s) in enumerate(zip(r.shape, r.stock_shape)):
            for literal, other in ((d, s), (s, d)):
                if isinstance(literal, int) and isinstance(other, str):
                    assert adapter.clocks[other] != literal, (
                        f"region {r.name!r} dim {i}: literal {literal} beside clock {other!r}")


def test_token2wav_envelopes_follow_the_dit_depth():
    t2w = adapters.get("minicpmo-token2wav")
    shallow = build_catalog(t2w.with_clocks(dit_depth=2))
    for region in ("estimator_att_cache", "estimator_cnn_cache"):
        deep = build_catalog(t2w).region(region)
        assert shallow.region(region).stock_bytes * 8 == deep.stock_bytes
        assert shallow.region(region).declared_bytes * 8 == deep.declared_bytes
