"""Parallelize a plain policy model, and the pieces of a step that need the whole group: the global
gradient norm (clipped across meshes and expert groups) and the routers' load summed over ranks.

Every rank builds the same plain model (same config and seed) and calls `parallelize`; the step itself
is the trainer's (services.trainer.policy.PolicyRank), the only one there is.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from crucible.model.transformer import Transformer
from crucible.parallel.data import apply_fsdp
from crucible.parallel.expert import apply_expert_parallel, expert_weight_owners
from crucible.parallel.mesh import ParallelMesh


def parallelize(model: Transformer, *, mesh: ParallelMesh) -> Transformer:
    """Apply expert parallelism, then HSDP, to a plain model in place; returns the same object."""
    apply_expert_parallel(model, mesh=mesh)
    apply_fsdp(model, mesh=mesh)
    return model


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


@torch.no_grad()
def all_reduce_router_loads(model: Transformer) -> None:
    """Sum every router's token counts over all ranks, so `update_router_biases` sees the global load."""
    counts = [moe.router.tokens_per_expert for moe in model.moe_layers]
    if not counts:
        return
    flat = torch.cat(counts)
    dist.all_reduce(flat)
    for target, summed in zip(counts, flat.split([c.numel() for c in counts]), strict=True):
        target.copy_(summed)
