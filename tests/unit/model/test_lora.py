"""LoRA adapters (crucible.model.lora): a fresh adapter changes nothing, only adapters train, merged
weights give the adapted model's logits, and the exports load in transformers (merged) and PEFT
(adapter) with the trainer's logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import peft
import pytest
import torch
import transformers

from crucible.contracts.runconfig import LORA_TARGETS, RunConfig
from crucible.model import PRESETS, Transformer, build_model
from crucible.model.config import LoraSpec, ModelConfig
from crucible.model.hf import export_weights, load_pretrained
from crucible.model.lora import (
    attach,
    export_adapter,
    freeze_base,
    is_adapter,
    merge,
    read_adapter,
    spec_of,
    targetable,
)
from crucible.model.spec import PolicySpec

DENSE = dataclasses.replace(
    PRESETS["tiny-dense"], dim=32, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64
)
ALL = LoraSpec(rank=4, alpha=8.0, targets=LORA_TARGETS)
# fp32 logits of the same function computed two ways (W x + s B (A x) against (W + s B A) x): each
# reassociated product differs by a few fp32 ulps (2^-23 relative) of values of order 1, through two
# layers; 1e-4 on logits of order 1 leaves two orders of magnitude of margin.
FP32_TOLERANCE = 1e-4


def tokens(cfg: ModelConfig, seed: int = 0, shape=(2, 12)) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def trained(model: Transformer, seed: int = 1) -> Transformer:
    """Adapters moved away from their start, as training would (B no longer zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_fresh_adapter_leaves_the_model_exactly_as_it_was(precision: str) -> None:
    model = build_model(DENSE, precision=precision, seed=0)
    x = tokens(DENSE)
    with torch.no_grad():
        before = model(x).logits
        attach(model, ALL, seed=3)
        after = model(x).logits
    assert torch.equal(before, after)
    names = [n for n, _ in model.named_parameters() if is_adapter(n)]
    # every layer: q, k, v on the fused wqkv, o, and the three feed-forward projections; A and B each
    assert len(names) == DENSE.n_layers * 7 * 2
    assert "layers.0.attention.wqkv.lora.k_proj.B" in names
    assert all(m.precision == precision for m in model.modules() if hasattr(m, "precision"))


def test_adapters_are_the_same_for_the_same_seed_and_only_they_train() -> None:
    one, two = (build_model(DENSE, precision="fp32", seed=0) for _ in range(2))
    attach(one, ALL, seed=5)
    attach(two, ALL, seed=5)
    assert all(torch.equal(v, two.state_dict()[k]) for k, v in one.state_dict().items())
    freeze_base(one)
    before = {k: v.clone() for k, v in one.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in one.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):  # the first step moves only B (A's gradient is zero while B is)
        optimizer.zero_grad()
        one(tokens(DENSE)).logits.logsumexp(-1).mean().backward()
        optimizer.step()
    changed = {k for k, v in one.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(is_adapter(k) for k in changed)
    assert any(k.endswith(".A") for k in changed) and any(k.endswith(".B") for k in changed)


def test_targets_choose_the_projections_and_a_target_no_layer_has_is_refused() -> None:
    model = build_model(DENSE, precision="fp32", seed=0)
    attach(model, LoraSpec(rank=2, alpha=2.0, targets=("v_proj", "down_proj")), seed=0)
    assert {n.rsplit(".", 1)[0].split(".", 2)[2] for n, _ in model.named_parameters() if is_adapter(n)} == {
        "attention.wqkv.lora.v_proj",
        "feed_forward.w2.lora.down_proj",
    }
    moe = build_model(dataclasses.replace(PRESETS["tiny"], first_moe_layer=0), precision="fp32", seed=0)
    assert targetable(moe.cfg) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    with pytest.raises(ValueError, match="match no projection"):
        attach(moe, LoraSpec(rank=2, alpha=2.0, targets=("gate_proj",)), seed=0)


def test_a_run_s_lora_section_reaches_every_model_its_spec_builds() -> None:
    config = RunConfig.model_validate(
        {"model": {"source": "tiny-dense", "lora": {"rank": 2, "targets": ["v_proj", "q_proj"]}}}
    )
    assert config.model.lora is not None and config.model.lora.targets == ["q_proj", "v_proj"]  # canonical
    spec = PolicySpec.resolve(config)
    assert spec.lora == LoraSpec(rank=2, alpha=16.0, targets=("q_proj", "v_proj"))
    for model in (spec.initial_model(seed=0), spec.empty_model()):
        assert spec_of(model.state_dict()) == spec.lora
    with pytest.raises(ValueError, match="twice"):
        RunConfig.model_validate({"model": {"lora": {"targets": ["q_proj", "q_proj"]}}})
    with pytest.raises(ValueError):
        RunConfig.model_validate({"model": {"lora": {"targets": ["lm_head"]}}})


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_merged_weights_give_the_adapted_model_s_logits(precision: str) -> None:
    model = trained(build_model(DENSE, precision=precision, seed=0))
    attach(model, LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "up_proj")), seed=1)
    trained(model)
    state = model.state_dict()
    plain = Transformer(DENSE, precision=precision)
    plain.load_state_dict(merge(state, DENSE), strict=True)
    x = tokens(DENSE)
    with torch.no_grad():
        adapted, merged, base = model(x).logits, plain(x).logits, Transformer(DENSE, precision=precision)
    # bf16: merging moves a weight by its bf16 rounding (2^-9 relative) before the product rather than
    # after; over two layers of width 32 that stays below 2^-4 on logits of order 1.
    tolerance = FP32_TOLERANCE if precision == "fp32" else 2**-4
    assert (adapted - merged).abs().max().item() <= tolerance
    base.load_state_dict({k: v for k, v in state.items() if not is_adapter(k)})
    with torch.no_grad():
        assert (base(x).logits - adapted).abs().max().item() > 4 * tolerance  # the adapters matter
    plain_state = {k: v for k, v in state.items() if not is_adapter(k)}
    assert merge(plain_state, DENSE) is plain_state  # nothing to merge


def test_exports_load_in_transformers_merged_and_in_peft_as_an_adapter(tmp_path: Path) -> None:
    hf = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32).save_pretrained(tmp_path / "base")
    model = load_pretrained(tmp_path / "base")
    lora = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"))
    attach(model, lora, seed=2)
    trained(model)
    state = model.state_dict()
    x = tokens(model.cfg)
    with torch.no_grad():
        expected = model(x).logits

    export_weights(state, model.cfg, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    export_adapter(state, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert len([n for n, _ in adapted.named_modules() if n.endswith("lora_A.default")]) == 2 * 5
    with torch.no_grad():
        assert (merged.eval()(x).logits - expected).abs().max().item() <= FP32_TOLERANCE
        assert (adapted.eval()(x).logits - expected).abs().max().item() <= FP32_TOLERANCE
    with pytest.raises(ValueError, match="no adapter"):
        export_adapter({k: v for k, v in state.items() if not is_adapter(k)}, tmp_path / "none")


def test_crucible_serve_merges_a_peft_adapter_into_the_model_it_serves(tmp_path: Path) -> None:
    """`crucible serve SOURCE --adapter DIR`: the served weights are the adapted model's, and an adapter
    that does not fit the model is a clear error."""
    from chat_model import save_chat_model

    from crucible.serving.engine import ServingEngine

    source = save_chat_model(tmp_path / "chat")
    model = load_pretrained(source)
    attach(model, LoraSpec(rank=2, alpha=4.0, targets=("v_proj", "o_proj", "up_proj")), seed=0)
    trained(model)
    state = model.state_dict()
    export_adapter(state, tmp_path / "adapter")
    assert read_adapter(tmp_path / "adapter", model.cfg).keys() == {k for k in state if is_adapter(k)}
    engine = ServingEngine.from_source(str(source), adapter=tmp_path / "adapter")
    try:
        served = engine.batcher.model
        assert served is not None
        x = tokens(model.cfg)
        with torch.no_grad():
            assert (served(x).logits - model.eval()(x).logits).abs().max().item() <= FP32_TOLERANCE
    finally:
        engine.close()
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="not a plain LoRA adapter"):
        ServingEngine.from_source(str(source), adapter=tmp_path / "adapter")
    wide = build_model(DENSE, precision="fp32", seed=0)  # another model's adapter: shapes do not fit
    attach(wide, LoraSpec(rank=2, alpha=4.0, targets=("up_proj",)), seed=0)  # 48 rows, not 64
    export_adapter(trained(wide).state_dict(), tmp_path / "other")
    with pytest.raises(ValueError, match="do not fit"):
        ServingEngine.from_source(str(source), adapter=tmp_path / "other")
