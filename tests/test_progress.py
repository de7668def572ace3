"""Progress of long work: silent in library use, on a stream when asked (one line per message;
on a terminal the line of a running step is rewritten), with each class and its timings."""
import io

import pytest
import torch

import cadence_fx
from cadence_fx import progress
from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy


@pytest.fixture
def toy():
    model = PromptRetainedToy()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        _, state = model(torch.randn(1, 24, 64, generator=g), None)
    return model, state, torch.randn(1, 8, 64, generator=g)


@pytest.fixture(autouse=True)
def _hidden():
    yield
    progress.hide()


def test_library_use_is_silent(toy, capsys):
    model, state, x = toy
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    with torch.no_grad():
        compiled(x, state)
    assert compiled.counters.compiled_calls == 1
    assert "cadence-fx:" not in capsys.readouterr().err


def test_each_class_is_shown_with_its_place_and_times(toy):
    model, state, x = toy
    out = io.StringIO()
    progress.show(out)
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    with torch.no_grad():
        done = compiled.capture_catalog(x, state)
    lines = out.getvalue().splitlines()
    n = compiled.catalog.size
    assert all(done.values()) and len(done) == n == 6
    assert sum(": compiling ..." in ln for ln in lines) == n
    traced = [ln for ln in lines if ": traced " in ln]
    assert len(traced) == n and all(" s (" in ln and "passes" in ln for ln in traced)
    # capture_catalog's line per class: its place, how it came, the graphs, the time
    assert [ln.split(":")[1].split()[1] for ln in lines
            if ln.endswith(" s") and ": traced, 0 graphs, in " in ln] == \
        [f"{i}/{n}" for i in range(1, n + 1)]
    assert "\r" not in out.getvalue()          # not a terminal: plain lines


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_a_running_step_is_one_line_rewritten(toy):
    model, state, x = toy
    term = _Terminal()
    progress.show(term)
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    with torch.no_grad():
        compiled(x, state)
    text = term.getvalue()
    assert text.startswith("cadence-fx: class 1/6 ((24,), 8): compiling ...")
    assert "\r\x1b[Kcadence-fx: class 1/6 ((24,), 8): traced " in text and text.endswith("\n")
    progress.hide()
    with torch.no_grad():
        compiled(torch.randn(1, 8, 64), compiled(x, state)[1])   # a new class, not shown
    assert term.getvalue() == text
