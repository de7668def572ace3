"""The optional third-party packages the real-model tests run, and the skip when one is absent.

Only a missing third-party package skips a test. The project's own modules
(``cadence_fx.models.*``) are imported directly by the tests after ``require``, so an import
error in them is a failure, never a skip. Subpackages are looked up on disk: importing
``stepaudio2`` itself runs its ``__init__``, which needs packages the flow decoder never uses
(``cadence_fx.models.token2wav`` imports around it).
"""
from __future__ import annotations

import importlib.util
import os
from typing import List

import pytest

__all__ = ["TOKEN2WAV", "MOSHI", "missing", "require"]

# minicpmo==0.1.2 ships the package ``stepaudio2``; the flow decoder and HiFT live in two of its
# subpackages and need einops and scipy; both models' steps need numpy
TOKEN2WAV = ("numpy", "einops", "scipy", "stepaudio2", "stepaudio2.cosyvoice2",
             "stepaudio2.flashcosyvoice")
MOSHI = ("numpy", "einops", "moshi")
INSTALL = "pip install --no-deps minicpmo==0.1.2 moshi==0.2.13 && pip install einops scipy numpy"


def _present(name: str) -> bool:
    top, _, rest = name.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not rest:
        return spec is not None
    return any(os.path.isdir(os.path.join(root, *rest.split(".")))
               for root in spec.submodule_search_locations or ())


def missing(*names: str) -> List[str]:
    return [n for n in names if not _present(n)]


def require(*names: str) -> None:
    """Skip the calling test module unless every package in ``names`` is installed."""
    absent = missing(*names)
    if absent:
        pytest.skip(f"needs {', '.join(absent)} ({INSTALL})", allow_module_level=True)
