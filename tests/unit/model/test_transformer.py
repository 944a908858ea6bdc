import dataclasses

import pytest
import torch

from crucible.model import PRESETS, VOCAB_SIZE, ModelConfig, ModelOutput, build_model
from crucible.model.kvcache import RaggedBatch, SlotCache


def test_every_preset_has_the_byte_vocabulary_and_tiny_is_long_enough():
    assert {p.vocab_size for p in PRESETS.values()} == {VOCAB_SIZE} == {320}
    assert PRESETS["tiny"].max_seq_len >= 2048
    assert PRESETS["tiny-dense"].moe_layers == ()


def test_config_is_frozen_keyword_only_and_validated():
    with pytest.raises(TypeError):
        ModelConfig(64)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["tiny"].dim = 8  # type: ignore[misc]
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="top_k"):
        ModelConfig(num_experts=2, top_k=3)
    cfg = ModelConfig(dim=32, num_experts=8)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        ModelConfig.from_json('{"dimension": 3}')


def test_build_is_deterministic_in_the_seed_and_keeps_fp32_masters(cfg):
    a, b, c = (build_model(cfg, precision="bf16", seed=s) for s in (0, 0, 1))
    for name, t in a.state_dict().items():
        assert t.dtype == torch.float32, name
        assert torch.equal(t, b.state_dict()[name]), name
    assert not torch.equal(a.tok_embeddings.weight, c.tok_embeddings.weight)
    with pytest.raises(ValueError, match="precision"):
        build_model(cfg, precision="fp8")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "mxfp8"])
def test_forward_shapes_and_routes(cfg, tokens, precision):
    model = build_model(cfg, precision=precision)
    out = model(tokens)
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (2, 24, 320) and out.logits.dtype == torch.float32
    assert torch.isfinite(out.logits).all()
    assert out.routes.shape == (2, 24, 2, 2) and out.routes.dtype == torch.int64
    assert out.routes.min() >= 0 and out.routes.max() < cfg.num_experts
    assert (out.routes[..., 0] != out.routes[..., 1]).all()


def test_dense_layers_and_dense_model(cfg, tokens):
    mixed = build_model(dataclasses.replace(cfg, first_moe_layer=1), precision="fp32")
    assert mixed(tokens).routes.shape == (2, 24, 1, 2)
    dense = build_model(dataclasses.replace(cfg, num_experts=0), precision="fp32")
    assert dense(tokens).routes is None
    with pytest.raises(ValueError, match="without MoE"):
        dense(tokens, routes=torch.zeros(2, 24, 0, 2, dtype=torch.long))


def test_causal(cfg, tokens):
    model = build_model(cfg, precision="fp32")
    changed = tokens.clone()
    changed[:, 15:] = (changed[:, 15:] + 1) % 320
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a.logits[:, :15], b.logits[:, :15])
    assert not torch.allclose(a.logits[:, 15:], b.logits[:, 15:])


@pytest.mark.parametrize(("precision", "tol"), [("fp32", 1e-5), ("bf16", 2e-2)])
def test_incremental_decoding_matches_full_forward(cfg, tokens, precision, tol):
    model = build_model(cfg, precision=precision).eval()
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(batch_size=2, max_len=64)
        parts = [model(tokens[:, :10], cache=cache), model(tokens[:, 10:14], cache=cache)]
        parts += [model(tokens[:, t : t + 1], cache=cache) for t in range(14, 24)]
    assert cache.length == 24
    logits = torch.cat([p.logits for p in parts], dim=1)
    torch.testing.assert_close(logits, full.logits, atol=tol, rtol=tol)
    if precision == "fp32":
        assert torch.equal(torch.cat([p.routes for p in parts], dim=1), full.routes)


def test_cache_truncate_redecodes_the_same(cfg, tokens):
    model = build_model(cfg, precision="fp32").eval()
    with torch.no_grad():
        cache = model.new_cache(batch_size=2, max_len=32)
        model(tokens[:, :12], cache=cache)
        first = model(tokens[:, 12:13], cache=cache).logits
        cache.truncate(12)
        again = model(tokens[:, 12:13], cache=cache).logits
    torch.testing.assert_close(first, again)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(20)


def test_bad_input_is_refused(cfg, tokens):
    model = build_model(cfg, precision="fp32")
    with pytest.raises(ValueError, match="token ids"):
        model(torch.full((1, 3), 320))
    with pytest.raises(ValueError, match="int64"):
        model(tokens.float())
    with pytest.raises(ValueError, match="past the limit"):
        model(torch.zeros(1, 129, dtype=torch.long))
    cache = model.new_cache(batch_size=1, max_len=8)
    with pytest.raises(ValueError, match="cache holds 1"):
        model(tokens[:, :4], cache=cache)
    model(tokens[:1, :6], cache=cache)
    with pytest.raises(ValueError, match="past the limit"):
        model(tokens[:1, :3], cache=cache)
    assert cache.length == 6
    with pytest.raises(ValueError, match="max_seq_len"):
        model.new_cache(batch_size=1, max_len=1000)


def test_a_few_training_steps_lower_the_loss(cfg, tokens):
    model = build_model(cfg, precision="bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        logits = model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 320), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.update_router_biases()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    assert all(p.grad is not None for p in model.parameters())


def test_param_counts_and_dense_equivalent(cfg):
    for c in (cfg, dataclasses.replace(cfg, first_moe_layer=1, tie_embeddings=True), PRESETS["tiny-dense"]):
        model = build_model(c, precision="fp32")
        assert c.param_count() == sum(p.numel() for p in model.parameters())
    dense = cfg.dense_equivalent()
    assert dense.moe_layers == () and dense.ffn_dim == cfg.top_k * cfg.expert_dim + cfg.shared_expert_dim
    router = cfg.num_experts * cfg.dim * len(cfg.moe_layers)
    assert dense.param_count() == cfg.param_count(active=True) - router
    assert cfg.param_count(active=True) < cfg.param_count()


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_a_ragged_batch_gives_each_part_what_it_gives_alone(cfg, tokens, attention):
    """Decode rows and a prefill chunk packed into one forward (the continuous batcher's mixed step):
    every row's last logits, routes and cache the same as two forwards, one per part. fp32 throughout:
    the packed matmuls may block their reductions differently for another row count, a few ulps per
    layer on values of order 1, far inside 1e-5."""
    if attention == "mla":
        cfg = dataclasses.replace(cfg, attention="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                  qk_rope_head_dim=8, v_head_dim=8, rope_interleave=True)  # fmt: skip
    model = build_model(cfg, precision="fp32").eval()

    def filled() -> SlotCache:
        """Slots 0-1 hold 10 and 13 tokens (they decode next), slots 2-3 hold 4 and 0 (they prefill 6)."""
        cache = SlotCache.of(model.new_cache(batch_size=4, max_len=64))
        for slot, n in enumerate((10, 13, 4)):
            model(tokens[slot % 2 : slot % 2 + 1, :n], cache=cache.batch([slot]))
        return cache

    decode, prefill = tokens[:, 13:14], torch.stack([tokens[0, 4:10], tokens[1, :6]])
    with torch.no_grad():
        alone = filled()
        a = model(decode, cache=alone.batch([0, 1]), last_only=True)
        b = model(prefill, cache=alone.batch([2, 3]), last_only=True)
        packed = filled()
        ragged = RaggedBatch([(packed.batch([0, 1]), 1), (packed.batch([2, 3]), 6)])
        out = model(torch.cat([decode.reshape(-1), prefill.reshape(-1)])[None], cache=ragged, last_only=True)
    assert out.logits.shape == (4, 1, cfg.vocab_size)
    torch.testing.assert_close(out.logits, torch.cat([a.logits, b.logits]), atol=1e-5, rtol=1e-5)
    # routes of every packed token, in order
    assert torch.equal(out.routes[0], torch.cat([a.routes.flatten(0, 1), b.routes.flatten(0, 1)]))
    assert packed.lengths == alone.lengths == [11, 14, 10, 6]
    torch.testing.assert_close(packed.k, alone.k, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="ragged batch feeds"):
        model(decode, cache=RaggedBatch([(packed.batch([0, 1]), 1), (packed.batch([2, 3]), 6)]))
    with pytest.raises(ValueError, match="consecutive slots"):
        packed.batch([0, 2])  # scattered slots go as runs (`SlotCache.batches`)
    assert [b.rows for b in packed.batches([0, 2, 3])] == [[0], [2, 3]]
