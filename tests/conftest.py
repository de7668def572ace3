"""Fixtures shared by the test files (helpers that are plain functions are in ``helpers.py``)."""
import pytest

from cadence_fx.passes import exact_ops


@pytest.fixture
def fuse_on_cpu(monkeypatch):
    """Exact fusion on the CPU too: Inductor's C++ compiles the regions, each verified as on the
    device (fusion runs on ``exact_ops.DEVICES`` only, the device steps by default)."""
    monkeypatch.setattr(exact_ops, "DEVICES", ("cuda", "cpu"))
