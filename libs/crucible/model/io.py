"""Weights as safetensors files: the model's state dict under its stable names, plus its config; and
checkpoint directories (shards + manifest + config + tokenizer) that `crucible model import` writes."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from crucible.model.config import ModelConfig
from crucible.model.shards import DEFAULT_SHARD_BYTES, plan_shards

if TYPE_CHECKING:
    from crucible.model.transformer import Transformer

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


# --- checkpoint directories ----------------------------------------------------------------------

MANIFEST = "manifest.msgpack"
MODEL_CONFIG = "model_config.json"


def save_checkpoint(
    model: Transformer,
    directory: str | os.PathLike,
    *,
    tokenizer: Any = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write a Crucible checkpoint directory: safetensors shards, their manifest (the checkpoint store's
    WeightsManifest, shard uris relative to the directory), the model config and, if given, the
    tokenizer's files. Written beside the target and renamed into place: never half-written."""
    from safetensors.torch import save

    from crucible.contracts import encode
    from crucible.contracts.messages import ObjectRef, TensorEntry, WeightsManifest

    directory = Path(directory)
    if directory.exists():
        raise FileExistsError(f"{directory} already exists")
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        sizes = {k: v.numel() * v.element_size() for k, v in state.items()}
        entries, shards = [], []
        for index, names in enumerate(plan_shards(sizes=sizes, shard_bytes=shard_bytes)):
            data = save({n: state[n] for n in names}, metadata={"crucible": "checkpoint"})
            name = f"shard-{index}.safetensors"
            (partial / name).write_bytes(data)
            shards.append(ObjectRef(uri=name, sha256=hashlib.sha256(data).hexdigest(), size=len(data)))
            entries += [
                TensorEntry(
                    name=n,
                    shape=list(state[n].shape),
                    dtype=str(state[n].dtype).removeprefix("torch."),
                    shard=index,
                )
                for n in names
            ]
        manifest = WeightsManifest(
            run_id="local", version=0, step=0, created_at=time.time(), tensors=entries, shards=shards
        )
        (partial / MANIFEST).write_bytes(encode(manifest))
        (partial / MODEL_CONFIG).write_text(model.cfg.to_json() + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
        partial.rename(directory)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return directory


def load_checkpoint(directory: str | os.PathLike, *, precision: str = "fp32") -> Transformer:
    """The model of a checkpoint directory, every shard's sha256 and every tensor's shape checked."""
    from safetensors.torch import load

    from crucible.contracts import ContractError, decode
    from crucible.contracts.messages import WeightsManifest
    from crucible.model.transformer import Transformer

    directory = Path(directory)
    try:
        cfg = ModelConfig.from_json((directory / MODEL_CONFIG).read_text())
        manifest = decode((directory / MANIFEST).read_bytes(), WeightsManifest)
    except (OSError, ValueError, ContractError) as exc:
        raise ValueError(f"{directory} is not a Crucible checkpoint: {exc}") from None
    state: dict[str, torch.Tensor] = {}
    for ref in manifest.shards:
        data = (directory / ref.uri).read_bytes()
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise ValueError(f"{directory / ref.uri}: sha256 differs from the manifest")
        state |= load(data)
    model = Transformer(cfg, precision=precision)
    for entry in manifest.tensors:
        if entry.name not in state or list(state[entry.name].shape) != entry.shape:
            raise ValueError(f"{directory}: tensor {entry.name} is missing or not of shape {entry.shape}")
    model.load_state_dict(state, strict=True)
    return model.eval()
