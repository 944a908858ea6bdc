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
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch import nn

from crucible.model.moe import GroupedExperts
from crucible.model.transformer import Transformer
from crucible.parallel.expert import EXPERT_WEIGHTS, ExpertParallelMoE, gather_experts
from crucible.parallel.mesh import ParallelMesh


def _expert_placement(*, local_experts: int, shard: int):
    """Shard along E when every rank of the shard group gets an expert, else along the next dimension."""

    def placement(param: nn.Parameter) -> Shard | None:
        if local_experts >= shard or param.shape[1] % shard:
            return None
        return Shard(1)

    return placement


def apply_fsdp(model: Transformer, *, mesh: ParallelMesh, reshard_after_forward: bool = True) -> None:
    """Shard the model in place: experts over the expert-data mesh, blocks and the rest over the dense mesh."""
    config = mesh.config
    sum_only = dist.get_backend() == dist.Backend.GLOO
    sharded: list[FSDPModule] = []
    for moe in model.moe_layers:
        local = moe.experts.w1_EFD.shape[0]
        fully_shard(
            moe.experts,
            mesh=mesh.expert_data,
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=_expert_placement(local_experts=local, shard=config.expert_shard),
        )
        moe.experts.set_gradient_divide_factor(float(config.world_size))
        sharded.append(moe.experts)
    for block in model.layers:
        fully_shard(block, mesh=mesh.dense, reshard_after_forward=reshard_after_forward)
        sharded.append(block)
    fully_shard(model, mesh=mesh.dense)
    sharded.append(model)
    if sum_only:
        for module in sharded:
            module.set_force_sum_reduction_for_comms(True)


def _expert_owners(model: nn.Module) -> dict[str, ExpertParallelMoE]:
    owners = {}
    for prefix, module in model.named_modules():
        if isinstance(module, ExpertParallelMoE):
            for name in EXPERT_WEIGHTS:
                owners[f"{prefix}.experts.{name}"] = module
    return owners


def _full(tensor: torch.Tensor, owner: ExpertParallelMoE | None) -> torch.Tensor:
    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor if owner is None else gather_experts(tensor, moe=owner)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict (all experts, same keys as the plain model's) on every rank."""
    owners = _expert_owners(model)
    return {name: _full(value, owners.get(name)) for name, value in model.state_dict().items()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded gradients of every parameter that has one, by name, on every rank."""
    owners = _expert_owners(model)
    return {
        name: _full(param.grad, owners.get(name))
        for name, param in model.named_parameters()
        if param.grad is not None
    }


def is_expert_param(model: nn.Module, name: str) -> bool:
    """Whether a parameter name belongs to grouped experts (sharded over the expert-data mesh)."""
    module_name = name.rsplit(".", 1)[0]
    return isinstance(model.get_submodule(module_name), GroupedExperts)
