"""The policy model: decoder-only MoE transformer with MXFP8 GEMMs, router replay and a KV cache."""

from crucible.model.config import PRESETS, VOCAB_SIZE, ModelConfig
from crucible.model.kvcache import KVCache
from crucible.model.transformer import ModelOutput, Transformer, build_model

__all__ = ["PRESETS", "VOCAB_SIZE", "KVCache", "ModelConfig", "ModelOutput", "Transformer", "build_model"]
