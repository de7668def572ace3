"""Fixtures shared by the test files (helpers that are plain functions are in ``helpers.py``)."""
from typing import Callable

import pytest
import torch

from cadence_fx.passes import exact_ops


@pytest.fixture
def fuse_on_cpu(monkeypatch):
    """Exact fusion on the CPU too: Inductor's C++ compiles the regions, each verified as on the
    device (fusion runs on ``exact_ops.DEVICES`` only, the device steps by default)."""
    monkeypatch.setattr(exact_ops, "DEVICES", ("cuda", "cpu"))


@pytest.fixture(scope="module")
def cfm():
    """The real Token2Wav CFM step at DiT depth 2 (needs the stock packages: mark the test), one
    per test file: ``(step, spks, prompt, chunks)``, the speaker embedding and prompt state of
    ``prime_cfm`` and two chunks ``(mu, cond)`` of 50 and 56 frames drawn from seed 4."""
    from cadence_fx.models import token2wav
    token2wav.import_stock()
    step = token2wav.CFMStep(token2wav.build_cfm(depth=2))
    spks, prompt = token2wav.prime_cfm(step)
    g = torch.Generator().manual_seed(4)
    chunks = [(torch.randn(1, 80, w, generator=g), torch.zeros(1, 80, w)) for w in (50, 56)]
    return step, spks, prompt, chunks


@pytest.fixture
def failing_capture(monkeypatch):
    """``failing_capture(error, when)``: ``torch.cuda.graph`` replaced, for the test, by a graph
    whose ``n``-th capture (counted from 1) raises a fresh ``error`` (its type and arguments)
    wherever ``when(n)``; returns the list holding one item per capture entered."""
    def install(error: BaseException, when: Callable[[int], bool]) -> list:
        real, captures = torch.cuda.graph, []

        class Failing(real):
            def __enter__(self):
                captures.append(1)
                if when(len(captures)):
                    raise type(error)(*error.args)
                return super().__enter__()

        monkeypatch.setattr(torch.cuda, "graph", Failing)
        return captures
    return install


def pytest_collection_modifyitems(config, items):
    """A test that skips without CUDA is a GPU test: it gets the ``gpu`` mark, so the device's
    ``pytest -m gpu`` runs it even where its file marks only some tests (``-m gpu`` would
    otherwise pass over a CUDA test marked by its ``skipif`` alone). Tests that run on CUDA
    when it is there and on the CPU otherwise (``test_lanes``) carry the mark in their file."""
    for item in items:
        if any("CUDA" in m.kwargs.get("reason", "") for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)
