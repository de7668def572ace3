"""Wrong declarations are rejected before any model runs, and the error names the culprit."""
import dataclasses

import pytest

from cadence_fx import adapters
from cadence_fx.contract import Adapter, PromptRetained, Region, SlidingWindow
from cadence_fx.errors import ContractError

_CLOCKS = {"f_prompt": 302, "f_retained": 100, "f_chunk": 50, "heads": 8, "width": 128, "n": 10}

_GOOD = Region(
    name="att_cache", input="cache.att", output="1.att", dim=2,
    retention=PromptRetained("f_prompt", "f_retained"), advance="f_chunk", ordering="prepend",
    shape=("n", "heads", None, "width"), stock_shape=("n", "heads", 1000, "width"))


def _adapter(*regions, **kw):
    kw.setdefault("clocks", _CLOCKS)
    return Adapter(name="toy", regions=regions or (_GOOD,), **kw)


def _bad(**changes):
    return _adapter(dataclasses.replace(_GOOD, **changes))


def test_good_declaration_validates():
    assert _adapter().validate().name == "toy"


def test_unknown_clock_in_retention_names_clock_and_region():
    bad = _bad(retention=PromptRetained("f_prompt", "f_kept"))
    with pytest.raises(ContractError, match=r"region 'att_cache' \(retention\).*clock 'f_kept'"):
        bad.validate()


def test_unknown_window_clock_names_clock_and_region():
    bad = _bad(name="mel", retention=SlidingWindow("mel_window"))
    with pytest.raises(ContractError, match=r"region 'mel'.*'mel_window'"):
        bad.validate()


def test_unknown_advance_clock_names_clock_and_region():
    with pytest.raises(ContractError, match=r"region 'att_cache' \(advance\).*clock 'f_step'"):
        _bad(advance="f_step").validate()


def test_duplicate_region_names():
    twin = dataclasses.replace(_GOOD, input="cache.other", output="1.other")
    with pytest.raises(ContractError, match=r"\['att_cache'\] declared twice"):
        _adapter(_GOOD, twin).validate()


def test_ordering_must_be_prepend_or_append():
    with pytest.raises(ContractError, match=r"region 'att_cache'.*ordering 'sideways'"):
        _bad(ordering="sideways").validate()


def test_frame_dim_of_shape_must_be_none():
    with pytest.raises(ContractError, match=r"region 'att_cache'.*shape\[2\] must be None"):
        _bad(shape=("n", "heads", 402, "width")).validate()


def test_frame_dim_message_shows_the_offending_value():
    with pytest.raises(ContractError, match=r"got 402"):
        _bad(shape=("n", "heads", 402, "width")).validate()


def test_negative_clock():
    with pytest.raises(ContractError, match=r"clock 'f_chunk' = -50"):
        _adapter(clocks={**_CLOCKS, "f_chunk": -50}).validate()


def test_stock_shape_rank_mismatch():
    bad = _bad(stock_shape=("heads", 1000, "width"))
    match = r"region 'att_cache'.*stock_shape has 3 dims but shape has 4"
    with pytest.raises(ContractError, match=match):
        bad.validate()


def test_unknown_adapter_name():
    with pytest.raises(ContractError, match=r"no adapter named 'mosh'.*registered: .*moshi"):
        adapters.get("mosh")


def test_call_frames_without_call_input():
    with pytest.raises(ContractError, match=r"adapter 'toy' declares call_frames but no call_input"):
        _adapter(call_frames=("f_chunk",)).validate()


def test_unknown_call_clock():
    with pytest.raises(ContractError, match=r"call_frames of adapter 'toy'.*clock 'f_call'"):
        _adapter(call_frames=("f_call",), call_input="mu").validate()


def test_errors_are_value_errors():
    # callers that only know the standard library can still catch a bad declaration
    with pytest.raises(ValueError):
        _bad(ordering="sideways").validate()


@pytest.mark.parametrize("name", adapters.names())
def test_registered_adapters_validate(name):
    adapter = adapters.get(name)
    assert adapter.name == name
    with pytest.raises(TypeError):
        adapter.clocks["extra"] = 1  # declarations are frozen
