"""Rank functions for the tests of the parallel layout itself: the gradients of a plain language-model
loss through a parallelized model (expert parallelism x HSDP, on Crucible's preset shape and on an
imported Qwen3-MoE) against the plain model's on the whole batch, computed on the same rank. The step the
trainer takes (optimizer, loss scaling, skipped steps) is compared across layouts in policy_cases."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from crucible.model import ModelConfig, Transformer, build_model
from crucible.parallel.data import full_grads
from crucible.parallel.mesh import ParallelConfig, build_mesh
from crucible.parallel.train import clip_grad_norm_, parallelize

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


MAX_GRAD_NORM = 0.3
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


def reference_grads(*, precision: str, world: int, max_grad_norm: float, kind: str = "crucible") -> dict:
    """Loss, gradient norm and clipped gradients of the plain model on the global batch."""
    tokens, routes = global_batch(world, kind=kind)
    valid = global_valid(world)
    model = make_model(kind, precision)
    loss = lm_loss(model, tokens, routes, valid)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm) if max_grad_norm else None
    return {
        "loss": float(loss.detach()),
        "grad_norm": float(norm) if norm is not None else None,
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }


def _local_batch(
    world: int, rank: int, kind: str = "crucible"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def parallel_grads(
    shape: tuple[int, int, int],
    *,
    precision: str,
    max_grad_norm: float,
    naive_expert_grads: bool = False,
    kind: str = "crucible",
):
    """The parallelized model's loss (mean over ranks), gradient norm and full clipped gradients, each rank
    backpropagating the mean loss of its own slice (equal slices: HSDP's mean of them is the batch's)."""
    replicate, shard, expert = shape
    mesh = build_mesh(ParallelConfig(replicate=replicate, shard=shard, expert=expert))
    model = parallelize(make_model(kind, precision), mesh=mesh)
    if naive_expert_grads:
        for moe in model.moe_layers:
            moe.experts.set_gradient_divide_factor(float(mesh.expert_data.size()))
    tokens, routes, valid = _local_batch(dist.get_world_size(), dist.get_rank(), kind)
    loss = lm_loss(model, tokens, routes, valid)
    loss.backward()
    norm = clip_grad_norm_(model, max_norm=max_grad_norm)
    mean = loss.detach().reshape(1).clone()
    dist.all_reduce(mean)
    return {"loss": float(mean) / dist.get_world_size(), "grad_norm": norm}, full_grads(model)


def compare_shapes(shapes: list[tuple[int, int, int]], precision: str, kind: str = "crucible") -> list[dict]:
    """For each shape: errors of loss, gradient norm and gradients against the reference."""
    world = dist.get_world_size()
    ref = reference_grads(precision=precision, world=world, max_grad_norm=MAX_GRAD_NORM, kind=kind)
    report = []
    for shape in shapes:
        stats, grads = parallel_grads(shape, precision=precision, max_grad_norm=MAX_GRAD_NORM, kind=kind)
        report.append(
            {
                "shape": shape,
                "loss": abs(stats["loss"] - ref["loss"]) / abs(ref["loss"]),
                "grad_norm": abs(stats["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"],
                "clipped": ref["grad_norm"] > MAX_GRAD_NORM,
                "grads": _max_err(grads, ref["grads"]),
                "grads_rel": _rel_err(grads, ref["grads"]),
            }
        )
    return report


def naive_expert_reduction(shape: tuple[int, int, int]) -> dict:
    """Expert gradients under FSDP's default (mean over the expert-data mesh) against the reference."""
    ref = reference_grads(precision="fp32", world=dist.get_world_size(), max_grad_norm=0.0)
    _, grads = parallel_grads(shape, precision="fp32", max_grad_norm=0.0, naive_expert_grads=True)
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
        "qwen3_moe": compare_shapes([(2, 2, 2), (1, 4, 4)], "fp32", kind="qwen3_moe"),
        "naive": [naive_expert_reduction((2, 2, 2)), naive_expert_reduction((1, 4, 4))],
        "errors": shape_errors(),
    }
