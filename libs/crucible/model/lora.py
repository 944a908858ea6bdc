"""LoRA: low-rank adapters on the policy's projections (a run's `model.lora`).

A targeted projection computes W x + scale * B (A x), with A [rank, in] drawn at random and B [out, rank]
starting at zero, so a fresh adapter leaves the model exactly as it was; the trainer trains A and B and
freezes everything else. Targets use the Hugging Face names a PEFT user knows: q_proj, k_proj, v_proj
(rows of Crucible's fused `wqkv`, each with its own adapter), o_proj, and the dense feed-forward's
gate_proj, up_proj, down_proj. Routed experts (and MoE layers' shared experts) are not adapted.

An adapter lives inside its `Linear` (`layers.3.attention.wqkv.lora.q_proj.A`, `.B`, and `.scale`, a
buffer, so that a state dict says how to merge it without its run's config). Trainer and rollouts run the
same unmerged arithmetic, so behaviour and trainer logprobs agree as they do without adapters; `merge`
folds the adapters into plain weights (a Hugging Face export, `crucible serve`, another run's `model.init`)
and `export_adapter` writes a PEFT adapter directory that transformers + PEFT load onto the base model.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from crucible.contracts.runconfig import LORA_TARGETS
from crucible.model.config import LoraSpec, ModelConfig
from crucible.model.layers import Linear
from crucible.model.matmul import linear

_PROJECTIONS = {
    "attention.wqkv": ("q_proj", "k_proj", "v_proj"),
    "attention.wq": ("q_proj",),  # latent attention without a query compression
    "attention.wo": ("o_proj",),
    "feed_forward.w1": ("gate_proj",),
    "feed_forward.w3": ("up_proj",),
    "feed_forward.w2": ("down_proj",),
}
"""Crucible's module (inside a block) -> the Hugging Face projections its rows hold, in order."""
_MODULE = re.compile(r"^layers\.(\d+)\.(" + "|".join(map(re.escape, _PROJECTIONS)) + r")$")
_PEFT_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
MARK = ".lora."
"""What every adapter tensor's name contains, and no other tensor's."""


class Adapter(nn.Module):
    """One projection's update, scale * B (A x), at the model's precision (bf16 when that is mxfp8: a rank
    is too narrow for MX blocks)."""

    scale: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, in_features: int, out_features: int, *, rank: int, scale: float) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        self.register_buffer("scale", torch.tensor(float(scale)))
        self.precision = "fp32"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        precision = "fp32" if self.precision == "fp32" else "bf16"
        return linear(linear(x, self.A, precision=precision), self.B, precision=precision) * self.scale


def is_adapter(name: str) -> bool:
    return MARK in name


def projections(path: str, cfg: ModelConfig, out_features: int) -> list[tuple[str, int]]:
    """The (Hugging Face projection, rows) held by the module at `path`, in row order; [] for a module
    no adapter can target."""
    found = _MODULE.match(path)
    if found is None:
        return []
    names = _PROJECTIONS[found.group(2)]
    if len(names) == 1:
        return [(names[0], out_features)]
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return list(zip(names, (q, kv, kv), strict=True))


def targetable(cfg: ModelConfig) -> set[str]:
    """The projections of architecture `cfg` an adapter can target."""
    if cfg.attention == "mla":
        names = {"o_proj"} if cfg.q_lora_rank else {"q_proj", "o_proj"}
    else:
        names = {"q_proj", "k_proj", "v_proj", "o_proj"}
    if any(i not in cfg.moe_layers for i in range(cfg.n_layers)):  # a dense feed-forward somewhere
        names |= {"gate_proj", "up_proj", "down_proj"}
    return names


def check_targets(lora: LoraSpec, cfg: ModelConfig) -> None:
    """ValueError when none of `lora`'s targets is a projection of architecture `cfg`."""
    if not set(lora.targets) & targetable(cfg):
        raise ValueError(
            f"model.lora.targets {list(lora.targets)} match no projection of this model; it has "
            f"{sorted(targetable(cfg), key=LORA_TARGETS.index)}"
        )


def attach(model: nn.Module, lora: LoraSpec, *, seed: int = 0) -> None:
    """Give every targeted projection of `model` (a Transformer) a fresh adapter, the same for the same
    seed: A uniform in +-1/sqrt(in) (PEFT's default), B zero. ValueError if no module is targeted."""
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]  # a Transformer's
    check_targets(lora, cfg)
    generator = torch.Generator().manual_seed(seed)
    chosen: list[tuple[Linear, list[tuple[str, int]]]] = []
    for path, module in model.named_modules():
        if isinstance(module, Linear):
            parts = projections(path, cfg, module.weight.shape[0])
            if any(name in lora.targets for name, _ in parts):
                chosen.append((module, parts))
    assert chosen  # check_targets
    for module, parts in chosen:
        adapters = {}
        for name, rows in parts:
            if name not in lora.targets:
                continue
            adapter = Adapter(module.weight.shape[1], rows, rank=lora.rank, scale=lora.scale)
            bound = 1.0 / math.sqrt(module.weight.shape[1])
            with torch.no_grad():
                adapter.A.copy_(torch.rand(adapter.A.shape, generator=generator) * 2 * bound - bound)
            adapters[name] = adapter.to(module.weight.device)
        module.parts = tuple(parts)
        module.lora = nn.ModuleDict(adapters)
    model.set_precision(model.precision)  # type: ignore[operator]  # the adapters' precision


def freeze_base(model: nn.Module) -> None:
    """Only the adapters train."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))


def _adapted(state: dict[str, torch.Tensor]) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """module path -> projection -> {"A", "B", "scale"}."""
    found: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for key, value in state.items():
        if is_adapter(key):
            module, _, rest = key.partition(MARK)
            projection, _, tensor = rest.partition(".")
            found.setdefault(module, {}).setdefault(projection, {})[tensor] = value
    return found


def merge(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """`state` with its adapters folded into the weights they adapt (W + scale * B A, in fp32, stored at
    W's dtype) and their tensors dropped: a plain model's state dict. A state without adapters comes back
    as it is."""
    adapted = _adapted(state)
    if not adapted:
        return state
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for module, adapters in adapted.items():
        weight = out.get(module + ".weight")
        parts = [] if weight is None else projections(module, cfg, weight.shape[0])
        if unknown := sorted(adapters.keys() - {name for name, _ in parts}):
            raise ValueError(f"adapters {unknown} on {module}: the model has no such projection there")
        assert weight is not None  # it has parts
        merged = weight.float().clone()
        start = 0
        for name, rows in parts:
            if name in adapters:
                a = adapters[name]
                if (
                    a["B"].shape[0] != rows
                    or a["A"].shape[1] != weight.shape[1]
                    or a["A"].shape[0] != a["B"].shape[1]
                ):
                    raise ValueError(
                        f"adapter {module}.{name}: A {list(a['A'].shape)}, B {list(a['B'].shape)} do not fit "
                        f"a projection of {rows} x {weight.shape[1]}"
                    )
                merged[start : start + rows] += float(a["scale"]) * (a["B"].float() @ a["A"].float())
            start += rows
        out[module + ".weight"] = merged.to(weight.dtype)
    return out


def spec_of(state: dict[str, torch.Tensor]) -> LoraSpec | None:
    """The adapters a state dict holds (one rank and scale for all, as a run trains them), or None."""
    adapted = _adapted(state)
    if not adapted:
        return None
    shapes = {(int(a["A"].shape[0]), float(a["scale"])) for ads in adapted.values() for a in ads.values()}
    if len(shapes) != 1:
        raise ValueError(f"adapters of several ranks or scales: {sorted(shapes)}")
    ((rank, scale),) = shapes
    targets = sorted({name for ads in adapted.values() for name in ads}, key=LORA_TARGETS.index)
    return LoraSpec(rank=rank, alpha=scale * rank, targets=tuple(targets))


def _block(module: str) -> str:
    """The Hugging Face block of one of Crucible's modules in _PROJECTIONS."""
    return "self_attn" if module.startswith("attention.") else "mlp"


def _hf_module(module: str, projection: str) -> str:
    found = _MODULE.match(module)
    assert found is not None  # adapters live only on the modules _MODULE names
    return f"model.layers.{found.group(1)}.{_block(found.group(2))}.{projection}"


def export_adapter(
    state: dict[str, torch.Tensor], out: str | os.PathLike, *, base_model: str | None = None
) -> Path:
    """Write the adapters of `state` as a PEFT LoRA adapter directory (adapter_config.json and
    adapter_model.safetensors) for the Hugging Face export of the same base weights; returns `out`."""
    from safetensors.torch import save_file

    lora = spec_of(state)
    if lora is None:
        raise ValueError("these weights hold no adapter: the run did not set model.lora")
    tensors, modules = {}, []
    for module, adapters in _adapted(state).items():
        for projection, a in adapters.items():
            name = _hf_module(module, projection)
            modules.append(name)
            tensors[f"base_model.model.{name}.lora_A.weight"] = a["A"].float().contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = a["B"].float().contiguous()
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        # Exactly the modules adapted (a routed expert's gate_proj is not one of them).
        "target_modules": _exact(modules),
        "base_model_name_or_path": base_model,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def read_adapter(path: str | os.PathLike, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A PEFT LoRA adapter directory (this module's export, or one trained with PEFT on the same base) as
    Crucible adapter tensors for a model of architecture `cfg`, to `merge` into its weights. ValueError
    for an adapter that is not plain LoRA on projections this module knows."""
    from safetensors.torch import load_file

    where = Path(path)
    config = json.loads((where / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA" or config.get("use_rslora") or config.get("use_dora"):
        raise ValueError(f"{where}: not a plain LoRA adapter (peft_type LORA, no rsLoRA or DoRA)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{where}: per-module ranks or alphas are not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise ValueError(f"{where}: adapter_config.json needs a positive integer r and a lora_alpha")
    absent = "attention.wqkv" if cfg.attention == "mla" else "attention.wq"
    modules = {
        (_block(module), name): module
        for module, names in _PROJECTIONS.items()
        if module != absent
        for name in names
    }
    out: dict[str, torch.Tensor] = {}
    for key, tensor in load_file(str(where / "adapter_model.safetensors")).items():
        match = _PEFT_KEY.match(key)
        module = None if match is None else modules.get((match.group(2), match.group(3)))
        if match is None or module is None:
            raise ValueError(f"{where}: tensor {key} is not a LoRA weight of a projection Crucible adapts")
        layer, projection, which = match.group(1), match.group(3), match.group(4)
        prefix = f"layers.{layer}.{module}{MARK}{projection}."
        out[prefix + which] = tensor.float()
        out[prefix + "scale"] = torch.tensor(float(alpha) / rank)
    if not out:
        raise ValueError(f"{where}: the adapter holds no LoRA weights")
    return out


def _exact(modules: Iterable[str]) -> str:
    """A regular expression PEFT matches module names against in full: exactly these names."""
    return "^(?:" + "|".join(re.escape(m) for m in sorted(set(modules))) + ")$"
