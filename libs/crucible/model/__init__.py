"""The policy model: decoder-only MoE transformer with MXFP8 GEMMs, router replay and a KV cache.

Names load on first use, so that `crucible.model.config` (presets, shapes) is importable without torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from crucible.model.config import PRESETS, VOCAB_SIZE, ModelConfig
    from crucible.model.kvcache import KVCache
    from crucible.model.transformer import ModelOutput, Transformer, build_model

_HOMES = {
    "PRESETS": "crucible.model.config",
    "VOCAB_SIZE": "crucible.model.config",
    "ModelConfig": "crucible.model.config",
    "KVCache": "crucible.model.kvcache",
    "ModelOutput": "crucible.model.transformer",
    "Transformer": "crucible.model.transformer",
    "build_model": "crucible.model.transformer",
}
__all__ = ["PRESETS", "VOCAB_SIZE", "KVCache", "ModelConfig", "ModelOutput", "Transformer", "build_model"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
