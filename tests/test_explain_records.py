"""``cadence-fx explain`` against what the compiler does, region kind by region kind.

For each kind (prompt-retained with its priming pass, ring, sliding window appended, prepended,
and full from the first call) a short stream runs through the compiled step, and each claim of
explain's text is read back and checked against the compiled records: the extents the classes
were compiled at, the carry's extent, the rewrite each class recorded for the region (in place,
retention, a window written in place at the end it keeps), and the priming pass compiled as a
class of its own, never run stock."""
import re

import pytest
import torch

import cadence_fx
from cadence_fx.contract import APPEND, PREPEND
from cadence_fx.explain import explain, explain_text
from cadence_fx.models.toy import (CONV_ADAPTER, PROMPT_RETAINED_ADAPTER, RING_ADAPTER,
                                   ConvLeftContextToy, PromptRetainedToy, RingToy)
from streaming_window import W, Window, window_step_adapter


# -- streams, one per region kind -----------------------------------------------------------------

def _prompt_stream(step):
    g = torch.Generator().manual_seed(1)
    y, state = step(torch.randn(1, 24, 64, generator=g), None)       # the priming pass
    for width in (8, 8, 8, 8, 10):
        y, state = step(torch.randn(1, width, 64, generator=g), state)


def _ring_stream(step):
    g = torch.Generator().manual_seed(2)
    kv, offset = torch.zeros(2, 1, 2, 16, 16), torch.zeros(1, dtype=torch.long)
    for _ in range(4):
        y, kv, offset = step(torch.randn(1, 1, 32, generator=g), kv, offset)


def _conv_stream(step):
    g = torch.Generator().manual_seed(3)
    conv, att = torch.zeros(1, 32, 2), torch.zeros(1, 64, 0)
    for _ in range(3):
        y, conv, att = step(torch.randn(1, 32, 4, generator=g), conv, att)


def _window_stream(step):
    g = torch.Generator().manual_seed(4)
    state = {"k": torch.zeros(1, 2, 0, 4)}
    for _ in range(5):
        y, state = step(torch.randn(1, 2, 2, 4, generator=g), state)


CASES = {   # kind -> (model, adapter, stream, region)
    "prompt-retained": (PromptRetainedToy, PROMPT_RETAINED_ADAPTER, _prompt_stream, "att"),
    "ring": (RingToy, RING_ADAPTER, _ring_stream, "kv"),
    "window-append": (lambda: Window("slice", reads_window=False),
                      window_step_adapter(APPEND, name="explained-append"), _window_stream, "k"),
    "window-prepend": (lambda: Window("prepend", reads_window=False),
                       window_step_adapter(PREPEND, name="explained-prepend"), _window_stream, "k"),
    "window-full-from-the-start": (ConvLeftContextToy, CONV_ADAPTER, _conv_stream, "conv"),
}


def _block(text: str, region: str) -> dict:
    """explain's lines of one region, keyed by their label."""
    lines = text.split(f"region {region}  (", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    return {line.split()[0]: line.split(None, 1)[1] for line in lines}


@pytest.mark.parametrize("kind", list(CASES))
def test_explain_says_what_the_compiled_records_show(kind):
    make, adapter, stream, name = CASES[kind]
    compiled = cadence_fx.compile(make(), adapter)
    with torch.no_grad():
        stream(compiled)
    k = compiled.counters
    assert k.compiled_calls == k.calls > 0 and k.fallbacks == 0, dict(k.reasons)
    text = explain_text(explain(adapter))
    said = _block(text, name)
    i = [r.name for r in adapter.regions].index(name)
    records = {key[0][0][i]: [w for w in e.records.rewrites if w.region == name]
               for key, e in compiled.classes.items()}
    reached = sorted(e for e in records if e is not None)

    # extents: every class compiled at an extent explain lists
    extents = [int(e) for e in said["extents"].split(", ")]
    assert set(reached) <= set(extents) and reached, (reached, extents)
    # the carry: A+ as explain computes it is the carry's extent, room included
    carry = int(re.search(r"(\d+) frames:", said["carry"]).group(1))
    assert compiled.carries[name].extent == carry
    # where the extent starts: the priming pass is compiled (a class without state, no fallback)
    start = said["start"]
    if "priming pass" in start:
        assert "compiled" in start and "runs stock" not in start
        assert None in records and extents[0] in reached
    elif "empty on the first call" in start:
        assert 0 in reached
    else:   # the ring's size, or full context from the first call: one extent
        assert reached == [extents[0]] == [extents[-1]]
    # what retention keeps, against the rewrite each class recorded
    retention = said["retention"]
    kinds = {w.kind for ws in records.values() for w in ws}
    if retention.startswith("ring"):
        assert "written in place" in retention and kinds == {"in_place"}
    elif retention.startswith("prompt retained"):
        assert "keep the first f_prompt = 24 frames and the last f_retained = 16" in retention
        assert {w.kind for w in records[extents[-1]]} >= {"retention"}
    else:
        windows = [w.detail for ws in records.values() for w in ws if "became in-place" in w.detail]
        assert windows and kinds <= {"append", "retention"}, kinds
        for detail in windows:
            held, added = map(int, re.search(r"(\d+) \+ (\d+) frames", detail).groups())
            lo, hi = map(int, re.search(r"window \[(\d+), (\d+)\)", detail).groups())
            if "prepended at index 0" in retention:
                assert "(prepend," in detail and (lo, hi) == (0, min(W, held + added)), detail
            else:
                assert "appended at the end" in retention and "keep the last" in retention
                assert "(append," in detail and hi == held + added, detail


def test_the_prepend_window_is_not_described_as_the_last_frames():
    said = _block(explain_text(explain(window_step_adapter(PREPEND, name="explained-prepend"))), "k")
    assert "keep the first W = 6 frames" in said["retention"] and "last" not in said["retention"]
