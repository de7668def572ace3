"""Fixtures shared by the test files (helpers that are plain functions are in ``helpers.py``)."""
import pytest

from cadence_fx import fusion


@pytest.fixture
def fuse_on_cpu(monkeypatch):
    """Exact fusion on the CPU too: Inductor's C++ compiles the regions, each verified as on the
    device (fusion runs on ``fusion.DEVICES`` only, the device steps by default)."""
    monkeypatch.setattr(fusion, "DEVICES", ("cuda", "cpu"))
