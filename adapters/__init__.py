"""Adapters: one module per model family, declarations only. ``get(name)`` looks one up."""
from __future__ import annotations

import importlib
from typing import Dict, Tuple

from cadence_fx.contract import Adapter
from cadence_fx.errors import ContractError

__all__ = ["get", "names"]

_MODULES: Dict[str, str] = {
    "minicpmo-token2wav": "minicpmo_token2wav",
    "minicpmo-token2wav-hift": "minicpmo_token2wav",
    "minicpmo-token2wav-flow": "minicpmo_token2wav",
    "minicpmo-token2wav-cfm": "minicpmo_token2wav",
    "moshi": "moshi",
    "moshi-mimi": "moshi",
    "personaplex": "moshi",
    "freeze-omni": "freeze_omni",
    "llm-backbone": "llm_backbone",
}


def names() -> Tuple[str, ...]:
    return tuple(_MODULES)


def get(name: str) -> Adapter:
    """The registered adapter called ``name`` (e.g. ``"minicpmo-token2wav"``), validated."""
    if name not in _MODULES:
        raise ContractError(f"no adapter named {name!r}; use a registered one ("
                            f"registered: {', '.join(_MODULES)}) or pass an Adapter")
    module = importlib.import_module(f"{__name__}.{_MODULES[name]}")
    return module.ADAPTERS[name].validate()
