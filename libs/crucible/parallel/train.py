"""Parallelize a plain policy model and run optimizer steps on it: the entry points a trainer calls.

Every rank builds the same plain model (same config and seed), calls `parallelize`, and then runs
`parallel_train_step` on its own slice of the batch. The objective is the mean of the ranks' losses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from crucible.model.transformer import Transformer
from crucible.parallel.data import apply_fsdp
from crucible.parallel.expert import apply_expert_parallel, expert_weight_owners
from crucible.parallel.mesh import ParallelMesh


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW settings; `max_grad_norm` clips the global gradient norm (0 disables clipping)."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0


def parallelize(model: Transformer, *, mesh: ParallelMesh) -> Transformer:
    """Apply expert parallelism, then HSDP, to a plain model in place; returns the same object."""
    apply_expert_parallel(model, mesh=mesh)
    apply_fsdp(model, mesh=mesh)
    return model


def build_optimizer(model: Transformer, *, config: OptimizerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        model.parameters(),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
    )


def clip_grad_norm_(model: Transformer, *, max_norm: float) -> float:
    """Clip gradients to a global L2 norm of `max_norm` (0: measure only); returns the norm before clipping.

    Gradients sharded on different meshes are measured mesh by mesh; an expert weight's norm covers only
    this rank's experts, so squared expert norms are also summed over the expert group.
    """
    owners = expert_weight_owners(model)
    groups: dict[tuple[int, int], tuple[dist.ProcessGroup | None, list[torch.Tensor]]] = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        mesh_key = id(param.grad.device_mesh) if isinstance(param.grad, DTensor) else 0
        owner = owners.get(name)
        key = (mesh_key, id(owner.ep_group) if owner else 0)
        groups.setdefault(key, (owner.ep_group if owner else None, []))[1].append(param.grad)
    total_sq = 0.0
    for ep_group, grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=False)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = norm.detach().double().square()
        if ep_group is not None:
            dist.all_reduce(squared, group=ep_group)
        total_sq += float(squared)
    total = math.sqrt(total_sq)
    if max_norm > 0:
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for _, grads in groups.values():
                for grad in grads:
                    grad.mul_(coef)
    return total


def parallel_train_step(
    *,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Transformer], torch.Tensor],
    max_grad_norm: float = 1.0,
    balance_routers: bool = True,
) -> dict[str, float]:
    """One optimizer step; `loss_fn(model)` computes this rank's loss on its own batch slice.

    A padded slice must be run as `model(tokens, routes=..., valid_BT=...)`, as the single-process
    trainer does, so that only real tokens count in the routers' load summed below.

    With `balance_routers`, the routers' token counts are summed over all ranks and their selection
    biases updated from that global load (every rank ends with the same biases), as the single-process
    trainer step does. Returns the loss averaged over ranks and the global gradient norm before clipping.
    """
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    grad_norm = clip_grad_norm_(model, max_norm=max_grad_norm)
    optimizer.step()
    if balance_routers and model.moe_layers:
        all_reduce_router_loads(model)
        model.update_router_biases()
    mean_loss = loss.detach().float().reshape(1).clone()
    dist.all_reduce(mean_loss)
    return {"loss": float(mean_loss) / dist.get_world_size(), "grad_norm": grad_norm}


@torch.no_grad()
def all_reduce_router_loads(model: Transformer) -> None:
    """Sum every router's token counts over all ranks, so `update_router_biases` sees the global load."""
    counts = [moe.router.tokens_per_expert for moe in model.moe_layers]
    if not counts:
        return
    flat = torch.cat(counts)
    dist.all_reduce(flat)
    for target, summed in zip(counts, flat.split([c.numel() for c in counts])):
        target.copy_(summed)
