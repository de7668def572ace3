"""The records of a compile are typed (``passes/records.py``): every record a compile of the
prompt-retained toy writes is one of the record dataclasses, in the list of its kind, and
anything else is refused with an error that names the kinds."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import cadence_fx
from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
from cadence_fx.passes.context import PassContext
from cadence_fx.passes.records import (RECORD_KINDS, REWRITE_KINDS, FusedRegionRecord, Fusion,
                                       NearMiss, Records, Rewrite)


def _stream():
    compiled = cadence_fx.compile(PromptRetainedToy(), PROMPT_RETAINED_ADAPTER)
    g = torch.Generator().manual_seed(1)
    state = None
    with torch.no_grad():
        for t in (24, 8, 8, 8, 8):   # the prompt, then chunks until the history is full
            _, state = compiled(torch.randn(1, t, 64, generator=g), state)
    assert compiled.counters.compiled_calls == compiled.counters.calls == 5
    return compiled


def test_every_record_of_a_compile_is_a_record_dataclass_in_the_list_of_its_kind():
    compiled = _stream()
    kinds = set()
    for entry in compiled.classes.values():
        records = entry.records
        assert type(records) is Records
        for kind, name in RECORD_KINDS.items():
            assert records.of(kind) is getattr(records, name)
            for record in records.of(kind):
                assert type(record) is kind and dataclasses.is_dataclass(record)
                with pytest.raises(dataclasses.FrozenInstanceError):
                    record.detail = "changed"
                kinds.add(kind.__name__)
        assert all(w.kind in REWRITE_KINDS for w in records.rewrites)
        assert type(records.fusion) is Fusion   # on the CPU: skipped, with the reason
        assert records.fusion.skipped and records.fusion.regions == ()
        assert all(type(r) is FusedRegionRecord for r in records.fusion.regions)
        assert isinstance(records.probe_s, float)
        assert records.layout_reads == {r.region: r.op for r in records.reads}
    assert kinds >= {"Rewrite", "Piece", "PassRun", "LayoutRead"}, kinds
    assert {w.kind for e in compiled.classes.values() for w in e.records.rewrites} >= \
        {"envelope", "retention"}


def test_the_report_prints_the_records_with_the_keys_they_always_had():
    from cadence_fx.report import Report
    rows = Report(_stream()).classes()
    row = next(r for r in rows if r["rewrites"])
    assert set(row["rewrites"][0]) == {"kind", "region", "detail"}
    assert set(row["passes"][0]) == {"name", "modified", "nodes_before", "nodes_after", "seconds"}
    assert all(set(p) == {"name", "kind", "nodes", "reasons"} and isinstance(p["reasons"], list)
               for r in rows for p in r["pieces"])


def test_an_unknown_kind_of_record_is_refused_with_the_kinds_it_may_be():
    records = Records()
    with pytest.raises(TypeError, match=r"dict is not a kind of record: a record is one of "
                                        r"Rewrite, NearMiss, .*passes/records\.py"):
        records.add({"kind": "retention", "region": "k", "detail": "as a dict"})
    with pytest.raises(TypeError, match="str is not a kind of record"):
        records.of(str)
    with pytest.raises(ValueError, match=r"unknown rewrite kind 'fused' \(region k\): a rewrite is "
                                         r"one of retention, append"):
        Rewrite("fused", "k", "not a rewrite the passes make")
    with pytest.raises(AttributeError):
        records.layout = {}   # no attribute but the typed ones
    with pytest.raises(TypeError, match="not subscriptable"):
        records["rewrites"]   # noqa: B018 - the dict it was is gone
    assert records == Records()   # nothing was added


def test_the_pass_context_notes_rewrites_and_near_misses_as_their_records():
    ctx = PassContext(adapter=PROMPT_RETAINED_ADAPTER, class_key=None, inputs=[], regions=[],
                      module_buffers={})
    ctx.note("retention", "att", "kept in place")
    ctx.note("near_miss", "att", "not a window")
    assert ctx.records.rewrites == [Rewrite("retention", "att", "kept in place")]
    assert ctx.records.near_misses == [NearMiss("att", "not a window")]
    assert ctx.records.near_misses[0].as_dict() == {"kind": "near_miss", "region": "att",
                                                     "detail": "not a window"}
    with pytest.raises(ValueError, match="unknown rewrite kind 'retained'"):
        ctx.note("retained", "att", "a misspelt kind")
