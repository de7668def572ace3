"""compile()'s options become one frozen CompileConfig, checked once: a value of the wrong kind
or a keyword that disagrees with options= is one ValueError naming the option and the fix."""
from __future__ import annotations

import dataclasses

import pytest

import cadence_fx
from cadence_fx.config import CompileConfig, Options
from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy


def _compile(**keywords):
    return cadence_fx.compile(PromptRetainedToy(), PROMPT_RETAINED_ADAPTER, **keywords)


def test_every_keyword_lands_in_the_one_frozen_config(monkeypatch):
    monkeypatch.delenv("CADENCE_FX_DISABLE_GRAPHS", raising=False)
    monkeypatch.delenv("CADENCE_FX_CACHE_DIR", raising=False)
    compiled = _compile(strict=True, verify=True, copy_outputs=False, keep_before=False,
                        state_rule=False, fuse=False)
    assert compiled.config == CompileConfig(
        options=Options(state_rule=False, fuse_exact=False), strict=True, verify=True,
        copy_outputs=False, keep_before=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        compiled.config.strict = False
    assert [n for n, _ in compiled.pipeline] == [n for n, _ in _compile(
        options=Options(state_rule=False, fuse_exact=False)).pipeline]


def test_the_environment_fills_what_was_not_given(monkeypatch, tmp_path):
    monkeypatch.setenv("CADENCE_FX_DISABLE_GRAPHS", "1")
    monkeypatch.setenv("CADENCE_FX_CACHE_DIR", str(tmp_path))
    config = _compile().config
    assert config.graphs is False and config.cache_dir == str(tmp_path)
    given = _compile(graphs=True, cache_dir=tmp_path / "mine").config   # a keyword wins
    assert given.graphs is True and given.cache_dir == tmp_path / "mine"


@pytest.mark.parametrize("keywords, message", [
    (dict(verify="yes"), r"compile\(\): verify='yes' is not a switch; give verify=True or verify=False"),
    (dict(fuse=1), r"compile\(\): fuse=1 is not a switch; give fuse=True or fuse=False"),
    (dict(options={"fuse_exact": False}),
     r"options=\{'fuse_exact': False\} \(dict\) is not pass options; give options=Options\("),
    (dict(cache_dir=3), r"cache_dir=3 \(int\) is not a directory; give a directory path"),
    (dict(tracing_mode="real"), r"tracing_mode 'real'.*use 'fake'"),
    # every disagreement at once, in one error
    (dict(state_rule=False, fuse=False, options=Options()),
     r"compile\(\): state_rule=False, fuse=False disagrees with options=Options\("),
])
def test_a_wrong_option_is_one_error_naming_it_and_the_fix(keywords, message):
    with pytest.raises(ValueError, match=message):
        _compile(**keywords)


def test_a_switch_that_agrees_with_options_is_no_error():
    compiled = _compile(fuse=False, options=Options(fuse_exact=False))
    assert compiled.config.options == Options(fuse_exact=False)
