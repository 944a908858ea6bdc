"""Rank functions for the distributed tests: each compares a parallel training step with a single-process
reference computed on the same rank (the whole global batch through the plain model)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from crucible.model import ModelConfig, Transformer, build_model
from crucible.parallel.data import full_grads, full_state_dict
from crucible.parallel.mesh import ParallelConfig, build_mesh
from crucible.parallel.train import (
    OptimizerConfig,
    build_optimizer,
    parallel_train_step,
    parallelize,
)

CFG = ModelConfig(
    vocab_size=64,
    dim=16,
    n_layers=3,
    n_heads=2,
    n_kv_heads=1,
    max_seq_len=16,
    ffn_dim=16,
    num_experts=8,
    top_k=2,
    expert_dim=8,
    shared_expert_dim=8,
    first_moe_layer=1,
)
QWEN3_MOE = dict(  # a tiny Qwen3-MoE built locally with transformers, imported: every layer sparse
    vocab_size=64, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
    head_dim=8, intermediate_size=16, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, max_position_embeddings=16,
)  # fmt: skip


def make_model(kind: str, precision: str) -> Transformer:
    """The model of a case, identical on every rank: Crucible's preset shape or an imported Qwen3-MoE."""
    if kind == "crucible":
        return build_model(CFG, precision=precision, seed=0)
    import transformers

    from crucible.model.hf import from_transformers

    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE, initializer_range=0.2))
    model = from_transformers(hf)
    model.set_precision(precision)
    return model.train()


def n_moe_layers(kind: str) -> int:
    return len(CFG.moe_layers) if kind == "crucible" else QWEN3_MOE["num_hidden_layers"]


OPT = OptimizerConfig(lr=1e-3, eps=1e-5, weight_decay=0.1, max_grad_norm=0.3)
BATCH_PER_RANK, SEQ = 2, 16
UNUSED_EXPERTS = (6, 7)  # never chosen in the first MoE layer: whole expert ranks get no rows


def global_batch(world: int, *, seed: int = 0, kind: str = "crucible") -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [W*B, T] and routes [W*B, T, 2, k]: layer 0 replays a skewed routing, layer 1 routes freely."""
    g = torch.Generator().manual_seed(seed)
    B = world * BATCH_PER_RANK
    tokens = torch.randint(0, CFG.vocab_size, (B, SEQ), generator=g)
    probs = torch.tensor([8.0, 4.0, 2.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    first = torch.multinomial(probs.expand(B * SEQ, -1), CFG.top_k, replacement=False, generator=g)
    routes = torch.full((B, SEQ, n_moe_layers(kind), CFG.top_k), -1, dtype=torch.long)
    routes[:, :, 0] = first.view(B, SEQ, CFG.top_k)
    return tokens, routes


def global_valid(world: int) -> torch.Tensor:
    """[W*B, T], 1 at real tokens: rows end in 0, 3, 6 or 9 padding positions, as in a padded training
    batch, so the routers' load (real tokens only) differs from the count of all positions."""
    lengths = SEQ - 3 * (torch.arange(world * BATCH_PER_RANK) % 4)
    return (torch.arange(SEQ)[None, :] < lengths[:, None]).float()


def lm_loss(
    model: Transformer, tokens: torch.Tensor, routes: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    logits = model(tokens, routes=routes, valid_BT=valid).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, CFG.vocab_size), tokens[:, 1:].reshape(-1))


def reference_step(*, precision: str, world: int, max_grad_norm: float, kind: str = "crucible") -> dict:
    """Loss, clipped gradients and parameters after one step of the plain model on the global batch."""
    tokens, routes = global_batch(world, kind=kind)
    valid = global_valid(world)
    model = make_model(kind, precision)
    opt = torch.optim.AdamW(
        model.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay
    )
    loss = lm_loss(model, tokens, routes, valid)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm) if max_grad_norm else None
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    model.update_router_biases()  # as the trainer step does: selection biases move with the load
    return {
        "loss": float(loss.detach()),
        "grad_norm": float(norm) if norm is not None else None,
        "grads": grads,
        "params": {n: t.clone() for n, t in model.state_dict().items()},
    }


def _local_batch(world: int, rank: int, kind: str = "crucible") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, routes = global_batch(world, kind=kind)
    rows = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    return tokens[rows], routes[rows], global_valid(world)[rows]


def _max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names=None) -> float:
    names = list(b) if names is None else names
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in names)


def _rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Global L2 error relative to the reference's global L2 norm."""
    diff = sum(float((a[n].float() - b[n].float()).square().sum()) for n in b)
    norm = sum(float(b[n].float().square().sum()) for n in b)
    return (diff / norm) ** 0.5


def _is_expert(name: str) -> bool:
    return ".experts." in name


def parallel_step(
    shape: tuple[int, int, int],
    *,
    precision: str,
    max_grad_norm: float,
    naive_expert_grads: bool = False,
    kind: str = "crucible",
):
    """One step of the parallelized model on this rank's slice; full gradients and parameters after it."""
    replicate, shard, expert = shape
    mesh = build_mesh(ParallelConfig(replicate=replicate, shard=shard, expert=expert))
    model = parallelize(make_model(kind, precision), mesh=mesh)
    if naive_expert_grads:
        for moe in model.moe_layers:
            moe.experts.set_gradient_divide_factor(float(mesh.expert_data.size()))
    opt = build_optimizer(model, config=OPT)
    tokens, routes, valid = _local_batch(dist.get_world_size(), dist.get_rank(), kind)
    stats = parallel_train_step(
        model=model,
        optimizer=opt,
        loss_fn=lambda m: lm_loss(m, tokens, routes, valid),
        max_grad_norm=max_grad_norm,
    )
    return stats, full_grads(model), full_state_dict(model)


def compare_shapes(shapes: list[tuple[int, int, int]], precision: str, kind: str = "crucible") -> list[dict]:
    """For each shape: errors of loss, grad norm, gradients and parameters against the reference."""
    world = dist.get_world_size()
    ref = reference_step(precision=precision, world=world, max_grad_norm=OPT.max_grad_norm, kind=kind)
    start = make_model(kind, precision).state_dict()
    ref_update = {n: ref["params"][n] - start[n] for n in start}
    report = []
    for shape in shapes:
        stats, grads, params = parallel_step(
            shape, precision=precision, max_grad_norm=OPT.max_grad_norm, kind=kind
        )
        update = {n: params[n] - start[n] for n in start}
        report.append(
            {
                "shape": shape,
                "loss": abs(stats["loss"] - ref["loss"]) / abs(ref["loss"]),
                "grad_norm": abs(stats["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"],
                "clipped": ref["grad_norm"] > OPT.max_grad_norm,
                "grads": _max_err(grads, ref["grads"]),
                "params": _max_err(params, ref["params"]),
                "router_bias": max(
                    float((params[n] - ref["params"][n]).abs().max()) for n in start if n.endswith("expert_bias")
                ),
                "router_bias_moved": max(
                    float(ref["params"][n].abs().max()) for n in start if n.endswith("expert_bias")
                ),
                "grads_rel": _rel_err(grads, ref["grads"]),
                "update_rel": _rel_err(update, ref_update),
            }
        )
    return report


def naive_expert_reduction(shape: tuple[int, int, int]) -> dict:
    """Expert gradients under FSDP's default (mean over the expert-data mesh) against the reference."""
    ref = reference_step(precision="fp32", world=dist.get_world_size(), max_grad_norm=0.0)
    _, grads, _ = parallel_step(shape, precision="fp32", max_grad_norm=0.0, naive_expert_grads=True)
    experts = [n for n in ref["grads"] if _is_expert(n)]
    dense = [n for n in ref["grads"] if not _is_expert(n)]
    dot = sum(float((grads[n] * ref["grads"][n]).sum()) for n in experts)
    norm = sum(float(ref["grads"][n].square().sum()) for n in experts)
    return {"expert_scale": dot / norm, "dense": _max_err(grads, ref["grads"], dense)}


def shape_errors() -> list[str]:
    """Messages of the errors for a mesh that does not match the world and for indivisible experts."""
    messages = []
    try:
        build_mesh(ParallelConfig(replicate=1, shard=2))
    except ValueError as exc:
        messages.append(str(exc))
    mesh = build_mesh(ParallelConfig(replicate=1, shard=4, expert=4))
    try:
        parallelize(build_model(dataclasses.replace(CFG, num_experts=6), precision="fp32"), mesh=mesh)
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def world_of_four() -> dict:
    """Everything the 4-process test checks, in one launch."""
    return {
        "fp32": compare_shapes([(2, 2, 2), (1, 4, 4), (2, 2, 4), (4, 1, 2), (1, 4, 1)], "fp32"),
        "mxfp8": compare_shapes([(2, 2, 2)], "mxfp8"),
        "qwen3_moe": compare_shapes([(2, 2, 2), (1, 4, 4)], "fp32", kind="qwen3_moe"),
        "naive": [naive_expert_reduction((2, 2, 2)), naive_expert_reduction((1, 4, 4))],
        "errors": shape_errors(),
    }


def world_of_eight() -> dict:
    return {"fp32": compare_shapes([(2, 4, 2), (1, 8, 4), (4, 2, 4), (2, 4, 8)], "fp32")}


def train_steps(shape: tuple[int, int, int], steps: int) -> list[float]:
    """Losses of `steps` parallel steps on the same batch (this rank's slice)."""
    replicate, shard, expert = shape
    mesh = build_mesh(ParallelConfig(replicate=replicate, shard=shard, expert=expert))
    model = parallelize(build_model(CFG, precision="fp32", seed=0), mesh=mesh)
    opt = build_optimizer(model, config=OPT)
    tokens, routes, valid = _local_batch(dist.get_world_size(), dist.get_rank())
    return [
        parallel_train_step(
            model=model,
            optimizer=opt,
            loss_fn=lambda m: lm_loss(m, tokens, routes, valid),
            max_grad_norm=OPT.max_grad_norm,
        )["loss"]
        for _ in range(steps)
    ]


def reference_losses(world: int, steps: int) -> list[float]:
    tokens, routes = global_batch(world)
    valid = global_valid(world)
    model = build_model(CFG, precision="fp32", seed=0)
    opt = torch.optim.AdamW(
        model.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay
    )
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = lm_loss(model, tokens, routes, valid)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.max_grad_norm)
        opt.step()
        model.update_router_biases()
        losses.append(float(loss.detach()))
    return losses
