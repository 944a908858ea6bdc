"""Shared fixtures for the model tests: toy sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from crucible.model import PRESETS, ModelConfig


@pytest.fixture
def cfg() -> ModelConfig:
    """Two layers, the second with 4 experts (top 2) and a shared expert."""
    return dataclasses.replace(
        PRESETS["tiny"],
        dim=32,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        expert_dim=32,
        num_experts=4,
        top_k=2,
        shared_expert_dim=16,
        first_moe_layer=0,
        max_seq_len=128,
    )


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
