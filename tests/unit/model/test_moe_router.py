import pytest
import torch
import torch.nn.functional as F

from crucible.model import build_model
from crucible.model.matmul import grouped_linear
from crucible.model.moe import MoE
from crucible.model.mxfp8 import fake_quantize_mxfp8


def _naive_moe(moe: MoE, x_ND: torch.Tensor) -> torch.Tensor:
    """Token by token: router scores, top-k with bias, each expert as a plain SwiGLU."""
    r, ex = moe.router, moe.experts
    out = []
    for x in x_ND:
        scores = torch.sigmoid(r.weight @ x)
        ids = torch.topk(scores + r.expert_bias, r.top_k).indices
        w = scores[ids] / scores[ids].sum()
        y = sum(
            wi * (ex.w2_EDF[e] @ (F.silu(ex.w1_EFD[e] @ x) * (ex.w3_EFD[e] @ x)))
            for wi, e in zip(w, ids, strict=True)
        )
        if moe.shared_expert is not None:
            s = moe.shared_expert
            y = y + s.w2.weight @ (F.silu(s.w1.weight @ x) * (s.w3.weight @ x))
        out.append(y)
    return torch.stack(out)


def test_dispatch_matches_a_token_by_token_reference(cfg):
    model = build_model(cfg, precision="fp32", seed=3)
    moe = model.layers[0].moe
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([0.0, 0.3, -0.2, 0.1]))
    x = torch.randn(1, 40, cfg.dim, generator=torch.Generator().manual_seed(0))
    y, ids = moe(x)
    torch.testing.assert_close(y[0], _naive_moe(moe, x[0]), atol=1e-5, rtol=1e-5)
    assert ids.shape == (1, 40, 2)


def test_grouped_linear_handles_empty_groups():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    counts = [4, 0, 3]
    ref = torch.cat([x[:4] @ w[0].T, x[4:] @ w[2].T])
    torch.testing.assert_close(grouped_linear(x, w, counts, precision="fp32"), ref)
    bf16 = grouped_linear(x, w, counts, precision="bf16")
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), ref, atol=0.05, rtol=0.02)
    mx = grouped_linear(x, w, counts, precision="mxfp8")
    q = fake_quantize_mxfp8
    torch.testing.assert_close(mx, torch.cat([q(x[:4]) @ q(w[0]).T, q(x[4:]) @ q(w[2]).T]))
    with pytest.raises(ValueError, match="counts"):
        grouped_linear(x, w, [4, 4, 3], precision="fp32")


def test_bias_steers_selection_but_not_the_weights(cfg):
    model = build_model(cfg, precision="fp32")
    router = model.layers[0].moe.router
    x = torch.randn(16, cfg.dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 5.0]))
    ids, weights = router(x)
    assert set(ids.flatten().tolist()) == {2, 3}
    scores = torch.sigmoid(x @ router.weight.T)[:, [2, 3]]
    torch.testing.assert_close(
        weights.sort(-1).values, (scores / scores.sum(-1, keepdim=True)).sort(-1).values
    )


def test_load_counts_in_training_only_and_bias_moves_against_load(cfg, tokens):
    model = build_model(cfg, precision="fp32")
    router = model.layers[0].moe.router
    model.eval()
    model(tokens)
    assert router.tokens_per_expert.sum() == 0
    model.train()
    model(tokens)
    load = router.tokens_per_expert.clone()
    assert load.sum() == tokens.numel() * cfg.top_k
    model.update_router_biases(rate=0.01)
    expected = 0.01 * torch.sign(load.mean() - load)
    torch.testing.assert_close(router.expert_bias, expected)
    assert router.tokens_per_expert.sum() == 0


def test_balancing_evens_out_a_skewed_router(cfg):
    model = build_model(cfg, precision="fp32")
    router = model.layers[0].moe.router
    with torch.no_grad():
        router.weight[0] += 0.5  # expert 0 scores high for most tokens
    x = torch.randn(256, cfg.dim, generator=torch.Generator().manual_seed(0)) + 1.0

    def spread():
        counts = torch.bincount(router(x)[0].flatten(), minlength=4).float()
        return (counts.max() - counts.min()).item()

    before = spread()
    router.tokens_per_expert.zero_()
    for _ in range(200):
        router(x)
        router.update_bias(rate=0.01)
    assert spread() < before / 2


def test_replay_reproduces_rollout_routes_after_the_router_moved(cfg, tokens):
    model = build_model(cfg, precision="bf16", seed=0).eval()
    with torch.no_grad():
        recorded = model(tokens).routes
    model.train()
    with torch.no_grad():
        for moe in model.moe_layers:
            g = torch.Generator().manual_seed(2)
            moe.router.weight.add_(torch.randn(moe.router.weight.shape, generator=g))
            moe.router.expert_bias.add_(torch.randn(cfg.num_experts, generator=g))
    fresh = model(tokens).routes
    assert not torch.equal(fresh, recorded)
    out = model(tokens, routes=recorded)
    assert torch.equal(out.routes, recorded)
    out.logits.logsumexp(-1).mean().backward()
    assert model.moe_layers[0].router.weight.grad.abs().sum() > 0


def test_replay_rows_of_minus_one_are_routed_afresh(cfg, tokens):
    model = build_model(cfg, precision="fp32").eval()
    fresh = model(tokens).routes
    replay = (fresh + 1) % cfg.num_experts
    replay[:, -3:] = -1
    out = model(tokens, routes=replay).routes
    assert torch.equal(out[:, :-3], replay[:, :-3])
    assert (out[:, -3:] >= 0).all()


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda r: r[:, :, :1], "shape"),
        (lambda r: r.float(), "integer"),
        (lambda r: r.fill_(7), "below num_experts"),
        (lambda r: r.fill_(1), "same expert twice"),
        (lambda r: r.index_fill_(3, torch.tensor([0]), -1), "all recorded or all -1"),
    ],
)
def test_bad_routes_are_refused(cfg, tokens, mutate, match):
    model = build_model(cfg, precision="fp32")
    routes = model(tokens).routes.clone()
    with pytest.raises(ValueError, match=match):
        model(tokens, routes=mutate(routes))


@pytest.mark.parametrize(("precision", "tol"), [("fp32", 1e-6), ("bf16", 1e-2)])
def test_decoding_path_for_few_tokens_matches_grouped_path(cfg, precision, tol):
    model = build_model(cfg, precision=precision, seed=4)
    moe = model.layers[0].moe
    x = torch.randn(1, cfg.dim, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[3, 1]])
    weights = torch.tensor([[0.7, 0.3]])
    grouped = moe.dispatch(x, ids, weights)  # grad enabled: sorted, grouped GEMMs
    with torch.no_grad():
        gathered = moe.dispatch(x, ids, weights)  # one token, two slots <= 4 experts: gathered weights
    torch.testing.assert_close(gathered.float(), grouped.float().detach(), atol=tol, rtol=tol)
