"""The pass pipeline (``passes/pipeline.py``): every rewrite is a registered pass with its
switch and its record, the order is checked (``ORDER``, ``NEEDS``) rather than stated in comments,
and each pass's ``modified`` says whether it rewrote anything. The four rewrites that prepare
fusion (``passes/fusion_prep.py``) are checked on the decoder's server traffic (its K/V caches
written in place) and the conformer stream, with fusion opened to the CPU: what each records agrees
with its ``modified``, and switching one off removes it and its record while the stream stays
bit-exact."""
from __future__ import annotations

import pytest

import cadence_fx
from cadence_fx import passes
from cadence_fx.passes.pipeline import (FUSION_PREP, ORDER, Options, PipelineOrderError, build_pipeline,
                                 check_order)

from streaming_conformer import one_thread  # noqa: F401 - autouse: one intra-op thread per file
from streaming_conformer import CONFORMER_ADAPTER, make_model, run_turns
from streaming_decoder import DECODER_ADAPTER, make_decoder
from helpers import same
from test_decoder_lifecycle import script

TURNS = [(0, [8, 12, 8, 4]), (1, [12, 8])]
RECORD = {"functional_temporaries": "inplace_made_functional", "cats_in_place": "cats_in_place",
          "split_conv_bias": "conv_bias_split", "contiguous_norm_inputs": "norm_inputs_copied"}


@pytest.fixture(scope="module")
def stock():
    return run_turns(make_model(), TURNS, seed=5)[0]


def test_the_default_pipeline_registers_every_rewrite_in_a_checked_order():
    names = [n for n, _ in build_pipeline(Options())]
    assert names == ["hoist_constants", "host_checks", "carry_retention", "mask_writes",
                     *FUSION_PREP, "fuse_exact", "shape_enumeration", "lower_guarded"]
    for k, name in enumerate(names):
        assert not set(ORDER.get(name, ())) & set(names[k + 1:])
    assert all(getattr(Options(), name) for name in FUSION_PREP)


def test_a_pass_out_of_order_or_missing_what_it_needs_is_refused():
    good = build_pipeline(Options())
    swapped = [p for p in good if p[0] != "cats_in_place"]
    swapped.insert([n for n, _ in swapped].index("fuse_exact") + 1, ("cats_in_place", passes.cats_in_place))
    with pytest.raises(PipelineOrderError, match="pass split_conv_bias must run after cats_in_place"):
        check_order(swapped)
    with pytest.raises(PipelineOrderError, match="lower_guarded needs shape_enumeration"):
        check_order([p for p in good if p[0] != "shape_enumeration"])


def test_each_fusion_rewrite_records_what_it_did_and_says_so(fuse_on_cpu):
    compiled = cadence_fx.compile(make_decoder(), DECODER_ADAPTER)
    assert same(script(make_decoder()), script(compiled), bits=True)
    assert compiled.counters.compiled_calls == compiled.counters.calls > 0
    for e in compiled.classes.values():
        ran = {p.name: p for p in e.records.passes}
        fusion_records = e.records.fusion
        for name, key in RECORD.items():
            assert ran[name].modified == (getattr(fusion_records, key) > 0), (name, fusion_records)
        assert ran["fuse_exact"].modified == (len(fusion_records.regions) > 0)
        # the K/V caches' cats: what the pass says it did is in the graph
        assert ran["cats_in_place"].modified and fusion_records.cats_in_place > 0


def test_a_fusion_rewrite_switched_off_is_gone_with_its_record(fuse_on_cpu, stock):
    compiled = cadence_fx.compile(make_model(), CONFORMER_ADAPTER,
                                  options=Options(functional_temporaries=False, cats_in_place=False))
    assert same(stock, run_turns(compiled, TURNS, seed=5)[0])
    assert compiled.counters.fused_regions > 0
    for e in compiled.classes.values():
        names = [p.name for p in e.records.passes]
        assert "cats_in_place" not in names and "functional_temporaries" not in names
        assert "split_conv_bias" in names and "fuse_exact" in names
        assert e.records.fusion.cats_in_place is None
        assert e.records.fusion.inplace_made_functional is None


def test_on_a_cpu_step_the_fusion_rewrites_leave_the_graph_alone(stock):
    compiled = cadence_fx.compile(make_model(), CONFORMER_ADAPTER)
    assert same(stock, run_turns(compiled, TURNS, seed=5)[0])
    for e in compiled.classes.values():
        assert not any(p.modified for p in e.records.passes if p.name in RECORD)
        assert e.records.fusion.skipped.startswith("fusion is for device steps")


def test_a_keyword_that_disagrees_with_options_is_an_error_not_an_override():
    with pytest.raises(ValueError, match=r"fuse=False disagrees with options=Options\("):
        cadence_fx.compile(make_model(), CONFORMER_ADAPTER, fuse=False, options=Options())
    agreed = cadence_fx.compile(make_model(), CONFORMER_ADAPTER, fuse=False,
                                options=Options(fuse_exact=False))
    assert "fuse_exact" not in [n for n, _ in agreed.pipeline]
    keyword = cadence_fx.compile(make_model(), CONFORMER_ADAPTER, state_rule=False)
    assert keyword.config.options == Options(state_rule=False)
