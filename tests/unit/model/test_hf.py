"""Hugging Face checkpoints in and out: tiny random models built locally with transformers (no
download), imported with the same logits and greedy continuation, exported and reloaded the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from crucible.model import KVCache
from crucible.model.hf import CheckpointError, cache_dir, export_pretrained, gguf_checkpoint, load_pretrained

SIZES = dict(
    vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=96, max_position_embeddings=128, initializer_range=0.2,
)  # fmt: skip
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "llama-tied": (transformers.LlamaConfig, {"tie_word_embeddings": True, "rope_theta": 100000.0}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 32}),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
    ),
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "olmoe": (transformers.OlmoeConfig, {"num_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        dict(
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
        ),
    ),
    "deepseek_v3-direct-q": (
        transformers.DeepseekV3Config,
        dict(
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=0,
            rope_interleave=False,
            n_group=1,
            topk_group=1,
        ),
    ),
}


def hf_model(family: str, seed: int = 0) -> transformers.PreTrainedModel:
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**(SIZES | extra))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms and biases away from their 1 / 0 init, so that a mapping error shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's selection bias, away from zero
                buffer.copy_(0.05 * torch.randn_like(buffer))
    return model


def tokens(seed: int, shape=(2, 12)) -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy_crucible(model, prompt: torch.Tensor, n: int) -> list[int]:
    cache: KVCache = model.new_cache(batch_size=1, max_len=prompt.shape[1] + n)
    logits = model(prompt, cache=cache).logits[0, -1]
    out = []
    for _ in range(n):
        token = int(logits.argmax())
        out.append(token)
        logits = model(torch.tensor([[token]]), cache=cache).logits[0, -1]
    return out


@torch.no_grad()
def greedy_hf(model, prompt: torch.Tensor, n: int) -> list[int]:
    ids = prompt
    for _ in range(n):
        token = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return ids[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_matches_transformers_and_export_reloads(family: str, tmp_path: Path) -> None:
    reference = hf_model(family)
    reference.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf")
    x = tokens(1)
    with torch.no_grad():
        expected = reference(x).logits
        got = model(x).logits
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4
    prompt = tokens(2, (1, 6))
    assert greedy_crucible(model, prompt, 32) == greedy_hf(reference, prompt, 32)

    export_pretrained(model, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (reloaded(x).logits - expected).abs().max().item() <= 1e-4


def test_fused_expert_layout_imports_too(tmp_path: Path) -> None:
    """transformers 5 keeps experts fused 3-D in memory ([E, 2F, D] gate then up, [E, D, F] down)."""
    from safetensors.torch import save_file

    reference = hf_model("qwen3_moe")
    reference.save_pretrained(tmp_path / "hf")
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state), sorted(state)[:8]
    (tmp_path / "fused").mkdir()
    save_file(state, str(tmp_path / "fused" / "model.safetensors"))
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    x = tokens(3)
    with torch.no_grad():
        assert (load_pretrained(tmp_path / "fused")(x).logits - reference(x).logits).abs().max() <= 1e-4


def test_sharded_checkpoints_import(tmp_path: Path) -> None:
    reference = hf_model("llama")
    reference.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    x = tokens(4)
    with torch.no_grad():
        assert (load_pretrained(tmp_path / "hf")(x).logits - reference(x).logits).abs().max() <= 1e-4


def _broken(tmp_path: Path, edit) -> Path:
    hf_model("qwen2").save_pretrained(tmp_path / "hf")
    edit(tmp_path / "hf")
    return tmp_path / "hf"


def _config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes))


def _drop_tensor(path: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    del state[name]
    save_file(state, str(path / "model.safetensors"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: _config(p, model_type="gpt2"), "model_type 'gpt2' is not supported"),
        (lambda p: _config(p, hidden_size=32), "has shape"),
        (lambda p: _drop_tensor(p, "model.layers.1.self_attn.k_proj.bias"), "k_proj.bias is missing"),
        (
            lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:1000]),
            "cannot read",
        ),
        (lambda p: _config(p, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
    ],
)
def test_bad_checkpoints_are_clear_errors(tmp_path: Path, edit, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(_broken(tmp_path, edit))


@pytest.mark.slow
def test_smollm2_from_its_package_answers_through_its_chat_template_like_transformers() -> None:
    from crucible.model.sources import load_tokenizer, package_file, resolve

    path = package_file("smollm2-135m-instruct")
    assert resolve("package:smollm2-135m-instruct").kind == "gguf"
    model = load_pretrained(path)
    assert (model.cfg.family, model.cfg.n_layers, model.cfg.vocab_size, model.cfg.tie_embeddings) == (
        "llama", 30, 49152, True)  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    # the weights came from the conversion cache, and so does the tokenizer Crucible uses
    converted = gguf_checkpoint(path)
    assert converted.parent.parent == cache_dir() and (converted / "model.safetensors").is_file()
    cached = load_tokenizer("package:smollm2-135m-instruct")
    again = cached.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    assert torch.equal(again if isinstance(again, torch.Tensor) else again["input_ids"], ids)
    ours = greedy_crucible(model, ids, 32)
    assert "Paris" in tokenizer.decode(ours)
    # transformers' own model on the weights its GGUF loader made (the converted directory)
    reference = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    assert ours == greedy_hf(reference, ids, 32)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_imported_models_run_in_bf16_and_mxfp8_and_replay_their_routes(family: str, tmp_path: Path) -> None:
    reference = hf_model(family)
    reference.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf")
    x = tokens(5)
    with torch.no_grad():
        exact = model(x)
        # The same experts, replayed. MXFP8's error at this weight scale (init std 0.2) is that of
        # Crucible's own tiny preset at the same scale (0.17 relative): it is the format, not the import.
        for precision, tolerance in (("bf16", 0.02), ("mxfp8", 0.25)):
            model.set_precision(precision)
            low = model(x, routes=exact.routes).logits
            error = ((low - exact.logits).norm() / exact.logits.norm()).item()
            assert 0 < error < tolerance, (precision, error)
        model.set_precision("fp32")
        # Router replay: with the recorded expert choices, a router whose weights changed routes the same.
        for moe in model.moe_layers:
            moe.router.weight.add_(torch.randn_like(moe.router.weight))
        assert not torch.equal(model(x).routes, exact.routes)
        replayed = model(x, routes=exact.routes)
    assert torch.equal(replayed.routes, exact.routes)


def test_a_gguf_whose_conversion_cannot_be_kept_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    from crucible.model.sources import package_file

    not_a_directory = tmp_path / "cache"
    not_a_directory.write_text("")
    monkeypatch.setenv("CRUCIBLE_CACHE_DIR", str(not_a_directory))
    with pytest.raises(CheckpointError, match="set CRUCIBLE_CACHE_DIR to a writable directory"):
        load_pretrained(package_file("smollm2-135m-instruct"))


def test_a_truncated_gguf_is_a_clear_error(tmp_path: Path) -> None:
    from crucible.model.sources import package_file

    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(package_file("smollm2-135m-instruct").read_bytes()[:4096])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: not a readable GGUF checkpoint"):
        load_pretrained(truncated)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3"])
def test_in_memory_models_convert_with_their_fused_experts(family: str) -> None:
    """from_transformers reads the layout transformers keeps in memory: fused experts, and for Mixtral
    the MoE under `mlp.` rather than the `block_sparse_moe.` of its files."""
    from crucible.model.hf import from_transformers

    reference = hf_model(family)
    assert any(k.endswith("experts.gate_up_proj") for k in reference.state_dict())
    x = tokens(6)
    with torch.no_grad():
        assert (from_transformers(reference)(x).logits - reference(x).logits).abs().max() <= 1e-4
