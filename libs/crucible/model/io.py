"""Weights as safetensors files: the model's state dict under its stable names, plus its config."""

from __future__ import annotations

import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from crucible.model.config import ModelConfig

CONFIG_KEY = "crucible.model_config"


def save_safetensors(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write every persistent tensor of `model` (fp32 masters unless `dtype` is given)."""
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.contiguous()
    meta = dict(metadata or {})
    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, ModelConfig):
        meta[CONFIG_KEY] = cfg.to_json()
    save_file(tensors, os.fspath(path), metadata=meta)


def load_safetensors(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy the tensors in `path` into `model`; names and shapes must match exactly."""
    expected = model.state_dict()
    with safe_open(os.fspath(path), framework="pt") as f:
        names = set(f.keys())
        missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{os.fspath(path)} does not match the model: "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        loaded = {}
        for name in expected:
            t = f.get_tensor(name)
            if t.shape != expected[name].shape:
                raise ValueError(
                    f"{name}: file has shape {tuple(t.shape)}, model has {tuple(expected[name].shape)}"
                )
            loaded[name] = t
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(loaded[name])


def load_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig saved alongside the weights."""
    with safe_open(os.fspath(path), framework="pt") as f:
        meta = f.metadata() or {}
    if CONFIG_KEY not in meta:
        raise ValueError(f"{os.fspath(path)} carries no model config")
    return ModelConfig.from_json(meta[CONFIG_KEY])
