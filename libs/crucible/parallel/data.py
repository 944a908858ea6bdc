"""Hybrid-sharded data parallelism (FSDP2 on a replicate x shard mesh) for the dense and expert weights.

Dense weights (attention, dense feed-forward, router, norms, embeddings, head) are sharded over the
dense mesh; their gradients are averaged over all W data-parallel ranks, which makes them the gradient
of the mean of the ranks' losses.

Expert weights are sharded over the expert-data mesh, which holds only the W/ep ranks that own the same
experts. Averaging over that mesh, FSDP's default, would be wrong: after the backward all-to-all a
rank's expert gradient already sums the contributions of every rank in its expert group, so the sum
over the expert-data mesh covers all W ranks once, and the mean is that sum divided by W, not W/ep.
Left at the default, expert gradients come out ep times too large. Their divide factor is set to W.

Gloo has no AVG or pre-multiplied-sum reduction, so on gloo the reductions sum and divide afterwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from crucible.model.transformer import Transformer
from crucible.parallel.expert import ExpertParallelMoE, expert_weight_owners, gather_experts
from crucible.parallel.mesh import ParallelMesh


def apply_fsdp(model: Transformer, *, mesh: ParallelMesh, reshard_after_forward: bool = True) -> None:
    """Shard in place: experts over the expert-data mesh, blocks and the rest over the dense mesh."""
    config = mesh.config
    gloo = dist.get_backend() == dist.Backend.GLOO
    for moe in model.moe_layers:
        # fully_shard returns the module it was given, now an FSDPModule
        experts = fully_shard(moe.experts, mesh=mesh.expert_data, reshard_after_forward=reshard_after_forward)
        experts.set_gradient_divide_factor(float(config.world_size))
        # Gloo lacks AVG and pre-multiplied sums, so reductions must be plain sums divided afterwards; but
        # with a one-rank shard group FSDP already divides while copying and would divide twice. That
        # path needs no forced sums: its only collective is the replicate all-reduce, a SUM anyway.
        experts.set_force_sum_reduction_for_comms(gloo and config.expert_shard > 1)
    blocks = [
        fully_shard(block, mesh=mesh.dense, reshard_after_forward=reshard_after_forward)
        for block in model.layers
    ]
    root = fully_shard(model, mesh=mesh.dense)
    if gloo:
        for block in blocks:
            block.set_force_sum_reduction_for_comms(True)
        root.set_force_sum_reduction_for_comms(True)


def _full(tensor: torch.Tensor, owner: ExpertParallelMoE | None) -> torch.Tensor:
    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor if owner is None else gather_experts(tensor, moe=owner)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict (all experts, same keys as the plain model's) on every rank."""
    owners = expert_weight_owners(model)
    return {name: _full(value, owners.get(name)) for name, value in model.state_dict().items()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded gradients of every parameter that has one, by name, on every rank."""
    owners = expert_weight_owners(model)
    return {
        name: _full(param.grad, owners.get(name))
        for name, param in model.named_parameters()
        if param.grad is not None
    }


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (the plain model's keys, all experts) into a parallelized model, in
    place: each rank keeps its experts' slice and its FSDP shard. Every rank must pass the same `state`;
    no collective runs. Missing or unexpected keys and shape mismatches raise, as a strict load does."""
    owners = expert_weight_owners(model)
    current = model.state_dict()
    missing, unexpected = sorted(current.keys() - state.keys()), sorted(state.keys() - current.keys())
    if missing or unexpected:
        raise KeyError(
            f"state dict does not fit the model: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, target in current.items():
        full = state[name]
        if (owner := owners.get(name)) is not None:
            local = owner.local_experts
            full = full[owner.ep_rank * local : (owner.ep_rank + 1) * local]
        if isinstance(target, DTensor):
            if tuple(full.shape) != tuple(target.shape):
                raise ValueError(f"{name}: shape {tuple(full.shape)}, the model's is {tuple(target.shape)}")
            # Every rank holds the same full tensor, so each takes its shard without communicating.
            shard = distribute_tensor(
                full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None
            ).to_local()
            target.to_local().copy_(shard)
        else:
            target.copy_(full)
