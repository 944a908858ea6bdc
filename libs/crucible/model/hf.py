"""Hugging Face checkpoints in and out of Crucible's one transformer.

In: a directory with config.json and safetensors (one file, or shards with model.safetensors.index.json;
experts stored per expert on disk or fused 3-D as transformers keeps them in memory), or a GGUF file
(dequantized by transformers' GGUF loader, once per file: the result is cached). Out: a directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads with the same logits, so the usual inference
stacks (vLLM, SGLang) can serve a trained policy.

Families (config.json `model_type`): llama (SmolLM2 and other Llama-style dense models), qwen2 (q/k/v
biases), qwen3 (per-head q/k RMSNorm), qwen3_moe, mixtral and olmoe (softmax top-k routers), deepseek_v3
(latent attention, sigmoid router with its selection bias, shared experts, dense first layers). Each
maps onto `ModelConfig` fields; nothing is a separate implementation.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from crucible.model.config import ModelConfig
from crucible.model.transformer import Transformer

DENSE = ("llama", "qwen2", "qwen3")
MOE = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3")
FAMILIES = DENSE + MOE
PRECISION_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be imported or exported: the message names the file, tensor or field."""


# --- config --------------------------------------------------------------------------------------


def _rope_theta(hf: dict[str, Any], where: str) -> float:
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or rope.get("rope_type") or "default"
    if kind != "default":
        raise CheckpointError(
            f"{where}: rope type {kind!r} is not supported (only the default rotary embedding)"
        )
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{where}: no rope_theta in config.json")
    return float(theta)


def config_from_hf(hf: dict[str, Any], *, where: str = "config.json") -> ModelConfig:
    """The ModelConfig of a transformers config (its config.json as a dict)."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias is not supported")
    try:
        dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        fields: dict[str, Any] = {
            "vocab_size": int(hf["vocab_size"]),
            "dim": dim,
            "n_layers": int(hf["num_hidden_layers"]),
            "n_heads": heads,
            "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
            "max_seq_len": int(hf.get("max_position_embeddings", 4096)),
            "rope_theta": _rope_theta(hf, where),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "head_size": int(hf.get("head_dim") or dim // heads),
            "qkv_bias": model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            "qk_norm": {"qwen3": "head", "qwen3_moe": "head", "olmoe": "full"}.get(model_type, "none"),
            "ffn_dim": int(hf["intermediate_size"]),
            "num_experts": 0,
            "family": model_type,
        }
        if model_type == "deepseek_v3":
            fields |= _deepseek_fields(hf, where)
        elif model_type in MOE:
            experts = int(hf.get("num_experts") or hf["num_local_experts"])
            fields |= {
                "num_experts": experts,
                "top_k": int(hf["num_experts_per_tok"]),
                "expert_dim": int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
                "router_scoring": "softmax",
                "norm_topk_prob": True if model_type == "mixtral" else bool(hf.get("norm_topk_prob", False)),
                "bias_update_rate": 0.0,  # these routers balance with an auxiliary loss, not a selection bias
                "first_moe_layer": 0,
            }
            if model_type == "qwen3_moe" and (
                hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1
            ):
                raise CheckpointError(
                    f"{where}: qwen3_moe with dense layers between sparse ones is not supported"
                )
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{where}: missing or malformed field {exc}") from None
    try:
        return ModelConfig(**fields)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def _deepseek_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    if hf.get("attention_bias"):
        raise CheckpointError(f"{where}: deepseek_v3 with attention_bias is not supported")
    if int(hf.get("moe_layer_freq", 1)) != 1:
        raise CheckpointError(f"{where}: deepseek_v3 with moe_layer_freq != 1 is not supported")
    nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    expert_dim = int(hf["moe_intermediate_size"])
    return {
        "attention": "mla",
        "n_kv_heads": int(hf["num_attention_heads"]),
        "head_size": nope + rope,
        "q_lora_rank": int(hf.get("q_lora_rank") or 0),
        "kv_lora_rank": int(hf["kv_lora_rank"]),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": int(hf["v_head_dim"]),
        "rope_interleave": bool(hf.get("rope_interleave", True)),
        "num_experts": int(hf["n_routed_experts"]),
        "top_k": int(hf["num_experts_per_tok"]),
        "expert_dim": expert_dim,
        "shared_expert_dim": expert_dim * int(hf.get("n_shared_experts") or 0),
        "first_moe_layer": int(hf.get("first_k_dense_replace", 0)),
        "route_scale": float(hf.get("routed_scaling_factor", 1.0)),
        "router_scoring": "sigmoid",
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "n_group": int(hf.get("n_group") or 1),
        "topk_group": int(hf.get("topk_group") or 1),
        "qkv_bias": False,
    }


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json for a model of a supported family (the inverse of config_from_hf)."""
    family = cfg.family or ("llama" if cfg.num_experts == 0 else "")
    if family not in FAMILIES:
        raise CheckpointError(
            "this model has no Hugging Face equivalent: Crucible's own MoE presets pair DeepSeek-V3's "
            "router with grouped-query attention; import a DeepSeek-V3 checkpoint to train one that exports"
        )
    if family == "llama" and (cfg.qkv_bias or cfg.qk_norm != "none"):
        raise CheckpointError("a llama model has neither q/k/v biases nor q/k norms")
    out: dict[str, Any] = {
        "model_type": family,
        "architectures": [ARCHITECTURES[family]],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "intermediate_size": cfg.ffn_dim,
        "attention_bias": cfg.qkv_bias and family != "qwen2",
        "torch_dtype": "float32",
    }
    if family == "deepseek_v3":
        out |= {
            "num_key_value_heads": cfg.n_heads,
            "head_dim": cfg.qk_rope_head_dim,
            "q_lora_rank": cfg.q_lora_rank or None,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "qk_head_dim": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim,
            "rope_interleave": cfg.rope_interleave,
            "n_routed_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.top_k,
            "moe_intermediate_size": cfg.expert_dim,
            "n_shared_experts": cfg.shared_expert_dim // cfg.expert_dim,
            "first_k_dense_replace": cfg.first_moe_layer,
            "routed_scaling_factor": cfg.route_scale,
            "norm_topk_prob": cfg.norm_topk_prob,
            "n_group": cfg.n_group,
            "topk_group": cfg.topk_group,
            "moe_layer_freq": 1,
            "num_nextn_predict_layers": 0,
        }
    elif family in MOE:
        out |= {
            "num_experts_per_tok": cfg.top_k,
            "norm_topk_prob": cfg.norm_topk_prob,
            "output_router_logits": False,
        }
        if family == "mixtral":
            out |= {"num_local_experts": cfg.num_experts, "intermediate_size": cfg.expert_dim}
        else:
            out |= {"num_experts": cfg.num_experts, "moe_intermediate_size": cfg.expert_dim}
        if family == "qwen3_moe":
            out |= {"decoder_sparse_step": 1, "mlp_only_layers": []}
    return out


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
MLP_NAMES = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
"""SwiGLU feed-forward (dense layers, shared experts): (Crucible, Hugging Face) weight names."""
MLA_NAMES = (
    ("wq_a", "q_a_proj"), ("q_norm", "q_a_layernorm"), ("wq_b", "q_b_proj"), ("wq", "q_proj"),
    ("wkv_a", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"), ("wkv_b", "kv_b_proj"), ("wo", "o_proj"),
)  # fmt: skip
"""Latent attention: (Crucible, Hugging Face) module names; wq_a/q_norm/wq_b or wq, by q_lora_rank."""


# --- tensors -------------------------------------------------------------------------------------


def _expert_names(family: str) -> tuple[str, str, str, str, str]:
    """(block prefix, router, gate, up, down) names of a family's per-expert layout on disk."""
    if family == "mixtral":
        return "block_sparse_moe", "gate", "w1", "w3", "w2"
    return "mlp", "gate", "gate_proj", "up_proj", "down_proj"


def to_crucible(hf: dict[str, torch.Tensor], cfg: ModelConfig, *, where: str) -> dict[str, torch.Tensor]:
    """Hugging Face tensor names (on-disk per-expert or fused layout) to Crucible's state dict."""
    take = _Taker(hf, where)
    out = {
        "tok_embeddings.weight": take("model.embed_tokens.weight"),
        "norm.weight": take("model.norm.weight"),
    }
    if not cfg.tie_embeddings:
        out["output.weight"] = take("lm_head.weight")
    else:
        take.discard("lm_head.weight")
    for i in range(cfg.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[q + "attention_norm.weight"] = take(p + "input_layernorm.weight")
        out[q + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
        attn = p + "self_attn."
        if cfg.attention == "mla":
            for ours, theirs in _mla_names(cfg):
                out[q + f"attention.{ours}.weight"] = take(attn + f"{theirs}.weight")
        else:
            out[q + "attention.wqkv.weight"] = torch.cat([take(attn + f"{x}_proj.weight") for x in "qkv"])
            if cfg.qkv_bias:
                out[q + "attention.wqkv.bias"] = torch.cat([take(attn + f"{x}_proj.bias") for x in "qkv"])
            out[q + "attention.wo.weight"] = take(attn + "o_proj.weight")
        if cfg.qk_norm != "none":
            out[q + "attention.q_norm.weight"] = take(attn + "q_norm.weight")
            out[q + "attention.k_norm.weight"] = take(attn + "k_norm.weight")
        if i not in cfg.moe_layers:
            for ours, theirs in MLP_NAMES:
                out[q + f"feed_forward.{ours}.weight"] = take(p + f"mlp.{theirs}.weight")
            continue
        block, router, gate, up, down = _expert_names(cfg.family)
        if not take.has(p + f"{block}.{router}.weight"):  # in memory every family keeps its MoE under mlp.
            block = "mlp"
        out[q + "moe.router.weight"] = take(p + f"{block}.{router}.weight")
        experts = p + f"{block}.experts."
        if take.has(experts + "gate_up_proj"):  # fused, as transformers holds it in memory
            gate_up = take(experts + "gate_up_proj")  # [E, 2F, D]: gate rows, then up rows
            out[q + "moe.experts.w1_EFD"], out[q + "moe.experts.w3_EFD"] = gate_up.chunk(2, dim=1)
            out[q + "moe.experts.w2_EDF"] = take(experts + "down_proj")  # [E, D, F]
        else:
            for ours, theirs in (("w1_EFD", gate), ("w3_EFD", up), ("w2_EDF", down)):
                out[q + f"moe.experts.{ours}"] = torch.stack(
                    [take(experts + f"{e}.{theirs}.weight") for e in range(cfg.num_experts)]
                )
        bias = p + f"{block}.{router}.e_score_correction_bias"
        out[q + "moe.router.expert_bias"] = take(bias) if take.has(bias) else torch.zeros(cfg.num_experts)
        if cfg.shared_expert_dim:
            for ours, theirs in MLP_NAMES:
                out[q + f"moe.shared_expert.{ours}.weight"] = take(
                    p + f"{block}.shared_experts.{theirs}.weight"
                )
    take.check_all_used()
    return {k: v.contiguous() for k, v in out.items()}


def from_crucible(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Crucible's state dict to Hugging Face names, experts per expert (the layout checkpoints keep on
    disk)."""
    family = hf_config(cfg)["model_type"]
    hd, H, KV = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    out = {
        "model.embed_tokens.weight": state["tok_embeddings.weight"],
        "model.norm.weight": state["norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["output.weight"]
    for i in range(cfg.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[p + "input_layernorm.weight"] = state[q + "attention_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = state[q + "ffn_norm.weight"]
        attn = p + "self_attn."
        if cfg.attention == "mla":
            for ours, theirs in _mla_names(cfg):
                out[attn + f"{theirs}.weight"] = state[q + f"attention.{ours}.weight"]
        else:
            for x, part in zip(
                "qkv", state[q + "attention.wqkv.weight"].split([H * hd, KV * hd, KV * hd]), strict=True
            ):
                out[attn + f"{x}_proj.weight"] = part
            if cfg.qkv_bias:
                for x, part in zip(
                    "qkv", state[q + "attention.wqkv.bias"].split([H * hd, KV * hd, KV * hd]), strict=True
                ):
                    out[attn + f"{x}_proj.bias"] = part
            out[attn + "o_proj.weight"] = state[q + "attention.wo.weight"]
        if cfg.qk_norm != "none":
            out[attn + "q_norm.weight"] = state[q + "attention.q_norm.weight"]
            out[attn + "k_norm.weight"] = state[q + "attention.k_norm.weight"]
        if i not in cfg.moe_layers:
            for ours, theirs in MLP_NAMES:
                out[p + f"mlp.{theirs}.weight"] = state[q + f"feed_forward.{ours}.weight"]
            continue
        block, router, gate, up, down = _expert_names(family)
        if family == "deepseek_v3":
            out[p + f"{block}.{router}.e_score_correction_bias"] = state[q + "moe.router.expert_bias"]
            for ours, theirs in MLP_NAMES:
                out[p + f"{block}.shared_experts.{theirs}.weight"] = state[
                    q + f"moe.shared_expert.{ours}.weight"
                ]
        elif bool(state[q + "moe.router.expert_bias"].any()):
            raise CheckpointError(
                f"layer {i}: the router's selection bias is not zero and has no {family} form"
            )
        out[p + f"{block}.{router}.weight"] = state[q + "moe.router.weight"]
        for ours, theirs in (("w1_EFD", gate), ("w3_EFD", up), ("w2_EDF", down)):
            for e, w in enumerate(state[q + f"moe.experts.{ours}"]):
                out[p + f"{block}.experts.{e}.{theirs}.weight"] = w
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def _mla_names(cfg: ModelConfig) -> list[tuple[str, str]]:
    absent = ("wq",) if cfg.q_lora_rank else ("wq_a", "q_norm", "wq_b")
    return [(ours, theirs) for ours, theirs in MLA_NAMES if ours not in absent]


class _Taker:
    """Hands out tensors of a checkpoint once each, with errors that name the file and tensor."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        self.tensors, self.where, self.used = tensors, where, set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def discard(self, name: str) -> None:
        self.used.add(name)

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"{self.where}: tensor {name} is missing")
        self.used.add(name)
        return self.tensors[name].to(torch.float32)

    def check_all_used(self) -> None:
        extra = sorted(set(self.tensors) - self.used)
        if extra:
            raise CheckpointError(f"{self.where}: tensors the model has no place for: {extra[:5]}")


# --- files ---------------------------------------------------------------------------------------


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory: one model.safetensors, or the shards its index names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index: {exc}") from None
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        file = path / name
        try:
            tensors |= load_file(os.fspath(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{file}: cannot read: {exc}") from None
    return tensors


def load_pretrained(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> Transformer:
    """A Crucible transformer with a checkpoint's weights: a Hugging Face directory or a .gguf file.
    Its forward on token ids [B, T] returns an object whose `.logits` are [B, T, vocab]."""
    if dtype not in PRECISION_OF_DTYPE:
        raise ValueError(f"dtype must be one of {list(PRECISION_OF_DTYPE)}, got {dtype}")
    path = Path(path)
    if path.suffix == ".gguf":
        path = gguf_checkpoint(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: neither a checkpoint directory nor a .gguf file")
    config_file = path / "config.json"
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{config_file}: cannot read: {exc}") from None
    tensors, where = read_safetensors_dir(path), os.fspath(path)
    cfg = config_from_hf(hf, where=where)
    return _instantiate(cfg, to_crucible(tensors, cfg, where=where), PRECISION_OF_DTYPE[dtype], where)


def _instantiate(cfg: ModelConfig, state: dict[str, torch.Tensor], precision: str, where: str) -> Transformer:
    model = Transformer(cfg, precision=precision)
    expected = model.state_dict()
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{where}: tensor for {name} has shape {tuple(tensor.shape)}, the config needs "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=True)
    return model.eval()


def gguf_checkpoint(path: str | os.PathLike) -> Path:
    """A GGUF file as a Hugging Face checkpoint directory (config.json, model.safetensors, the tokenizer's
    files), converted on first use by transformers' GGUF loader and kept in the conversion cache
    (`cache_dir()`), keyed by the file's sha256 and the converting libraries' versions. Dequantizing
    takes tens of seconds on a CPU; reading the cached directory back takes about one."""
    path = Path(path).resolve()
    where = os.fspath(path)
    if not path.is_file():
        raise CheckpointError(f"{where}: no such file")
    stat = path.stat()
    entry = cache_dir() / "gguf" / _gguf_key(path, stat.st_size, stat.st_mtime_ns)
    if (entry / "model.safetensors").is_file():
        return entry
    partial = entry.with_name(f"{entry.name}.{os.getpid()}.partial")
    try:
        partial.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(
            f"{where}: cannot write its conversion to {partial.parent} ({exc}); "
            "set CRUCIBLE_CACHE_DIR to a writable directory"
        ) from None
    try:
        _convert_gguf(path, partial)
        partial.rename(entry)
    except OSError:
        if not (entry / "model.safetensors").is_file():  # not a concurrent conversion that finished first
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return entry


@functools.lru_cache(maxsize=8)
def _gguf_key(path: Path, size: int, mtime_ns: int) -> str:
    """The file's sha256 with the converters' versions: read once per process while the file is unchanged
    (its config, tokenizer and weights each ask for the conversion)."""
    import transformers

    key = hashlib.sha256(f"gguf\n{transformers.__version__}\n{_version('gguf')}\n".encode())
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            key.update(block)
    return key.hexdigest()


def _convert_gguf(path: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # the loader raises many types for a truncated or foreign file
        raise CheckpointError(
            f"{path}: not a readable GGUF checkpoint: {type(exc).__name__}: {exc}"
        ) from None
    (out / "config.json").write_text(hf_model.config.to_json_string(use_diff=False))
    seen: set[int] = set()
    tensors = {}  # safetensors stores no storage twice: tied weights get a copy each
    for name, tensor in hf_model.state_dict().items():
        pointer = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if pointer in seen else tensor.contiguous()
        seen.add(pointer)
    save_file(tensors, out / "model.safetensors")
    tokenizer.save_pretrained(out)


def cache_dir() -> Path:
    """Where converted checkpoints are kept: $CRUCIBLE_CACHE_DIR, else $XDG_CACHE_HOME/crucible, else
    ~/.cache/crucible."""
    if os.environ.get("CRUCIBLE_CACHE_DIR"):
        return Path(os.environ["CRUCIBLE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "crucible"


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "none"


def export_pretrained(model: Transformer, out: str | os.PathLike) -> Path:
    """Write `model` as a Hugging Face checkpoint directory (config.json + model.safetensors)."""
    return export_weights(model.state_dict(), model.cfg, out)


def export_weights(state: dict[str, torch.Tensor], cfg: ModelConfig, out: str | os.PathLike) -> Path:
    """Write a Crucible state dict of architecture `cfg` as a Hugging Face checkpoint directory; adapters
    in it (model.lora) are merged into the weights they adapt."""
    from safetensors.torch import save_file

    from crucible.model.lora import merge

    out = Path(out)
    config = hf_config(cfg)
    tensors = from_crucible(merge(state, cfg), cfg)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "model.safetensors.partial"
    save_file(
        {k: v.to(torch.float32) for k, v in tensors.items()}, os.fspath(partial), metadata={"format": "pt"}
    )
    partial.rename(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def from_transformers(hf_model: Any, *, dtype: torch.dtype = torch.float32) -> Transformer:
    """A Crucible transformer with the weights of an in-memory transformers model (its fused layout)."""
    where = type(hf_model).__name__
    cfg = config_from_hf(hf_model.config.to_dict(), where=where)
    tensors = {k: v.detach() for k, v in hf_model.state_dict().items()}
    return _instantiate(cfg, to_crucible(tensors, cfg, where=where), PRECISION_OF_DTYPE[dtype], where)
