import dataclasses

import pytest
import torch
from safetensors import safe_open

from crucible.model import build_model
from crucible.model.io import load_config, load_safetensors, save_safetensors


def test_roundtrip_restores_weights_router_bias_and_config(cfg, tokens, tmp_path):
    model = build_model(cfg, precision="bf16", seed=5)
    with torch.no_grad():
        model.layers[1].moe.router.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.3, -0.4]))
    path = tmp_path / "w.safetensors"
    save_safetensors(model, path)
    other = build_model(cfg, precision="bf16", seed=6)
    load_safetensors(other, path)
    assert torch.equal(other(tokens).logits, model(tokens).logits)
    assert load_config(path) == cfg


def test_state_dict_names_are_stable(cfg, tmp_path):
    model = build_model(dataclasses.replace(cfg, first_moe_layer=1), precision="fp32")
    path = tmp_path / "w.safetensors"
    save_safetensors(model, path)
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
    per_layer = ["attention_norm.weight", "attention.wqkv.weight", "attention.wo.weight", "ffn_norm.weight"]
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    expected |= {f"layers.{i}.{n}" for i in range(2) for n in per_layer}
    expected |= {f"layers.0.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
    expected |= {
        f"layers.1.moe.{n}"
        for n in (
            "router.weight",
            "router.expert_bias",
            "experts.w1_EFD",
            "experts.w2_EDF",
            "experts.w3_EFD",
            "shared_expert.w1.weight",
            "shared_expert.w2.weight",
            "shared_expert.w3.weight",
        )
    }
    assert names == expected


def test_bf16_file_loads_into_fp32_masters(cfg, tmp_path):
    model = build_model(cfg, precision="bf16")
    path = tmp_path / "w.safetensors"
    save_safetensors(model, path, dtype=torch.bfloat16)
    other = build_model(cfg, precision="bf16", seed=9)
    load_safetensors(other, path)
    assert other.output.weight.dtype == torch.float32
    assert torch.equal(other.output.weight, model.output.weight.bfloat16().float())


def test_mismatched_file_is_refused(cfg, tmp_path):
    path = tmp_path / "w.safetensors"
    save_safetensors(build_model(cfg, precision="fp32"), path)
    with pytest.raises(ValueError, match="shape"):
        load_safetensors(build_model(dataclasses.replace(cfg, expert_dim=16), precision="fp32"), path)
    with pytest.raises(ValueError, match="missing"):
        load_safetensors(build_model(dataclasses.replace(cfg, n_layers=3), precision="fp32"), path)
