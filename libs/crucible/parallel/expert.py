"""Expert parallelism: each rank of an expert group keeps E/ep experts and tokens travel to them.

`apply_expert_parallel` cuts every MoE layer's grouped expert weights along E to this rank's experts
and swaps the layer's `dispatch` for an all-to-all version:

1. sort the local (token, slot) rows by expert, as the single-process dispatch does; experts are laid
   out rank by rank, so the rows are already grouped by destination rank;
2. exchange the per-expert row counts (all-to-all of E integers), giving every rank the split sizes;
3. all-to-all the rows (variable sizes; autograd sends gradients back the same way in reverse);
4. regroup the received rows by local expert, run the grouped experts, undo the regrouping;
5. all-to-all the outputs back and combine them with the routing weights where the tokens live.

Every rank runs the same collectives in the same order whatever the routing, including a rank whose
experts receive no rows: it still runs its experts on one zero row, so its expert weights get (zero)
gradients and its autograd graph keeps both all-to-alls, which the other ranks wait for in backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from crucible.model.moe import GroupedExperts, MoE
from crucible.model.transformer import Transformer
from crucible.parallel.mesh import ParallelMesh

EXPERT_WEIGHTS = ("w1_EFD", "w3_EFD", "w2_EDF")


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def all_to_all_rows(
    x: torch.Tensor, *, recv: list[int], send: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Rows of x, `send[r]` of them to rank r; returns `recv[r]` rows from each rank r, in rank order."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), recv, send, group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


class ExpertParallelMoE(MoE):
    """A MoE layer holding experts [ep_rank*E_local, (ep_rank+1)*E_local) of an expert-parallel group.

    Not constructed directly: `apply_expert_parallel` turns existing MoE layers into this class.
    """

    ep_group: dist.ProcessGroup
    ep_size: int
    ep_rank: int

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def dispatch(self, x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        N, K = ids_NK.shape
        P, L = self.ep_size, self.local_experts
        flat = ids_NK.flatten()
        order = torch.argsort(flat, stable=True)
        send_counts_E = torch.bincount(flat, minlength=self.num_experts)
        recv_counts_PL = torch.empty_like(send_counts_E)
        dist.all_to_all_single(recv_counts_PL, send_counts_E, group=self.ep_group)
        recv_counts_PL = recv_counts_PL.view(P, L)
        send = send_counts_E.view(P, L).sum(dim=1).tolist()
        recv = recv_counts_PL.sum(dim=1).tolist()

        x_recv = all_to_all_rows(x_ND[order // K], recv=recv, send=send, group=self.ep_group)
        expert_of_row = torch.repeat_interleave(
            torch.arange(L, device=flat.device).repeat(P), recv_counts_PL.flatten()
        )
        by_expert = torch.argsort(expert_of_row, stable=True)
        y_recv = self._run_local_experts(x_recv[by_expert], recv_counts_PL.sum(dim=0).tolist())
        y_recv = y_recv[_inverse(by_expert)]
        y_sorted = all_to_all_rows(y_recv, recv=send, send=recv, group=self.ep_group)

        y_flat = y_sorted[_inverse(order)]
        return (y_flat.view(N, K, -1) * weights_NK.unsqueeze(-1)).sum(dim=1)

    def _run_local_experts(self, x_MD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if sum(counts) > 0:
            return self.experts(x_MD, counts)
        padded = torch.cat([x_MD, x_MD.new_zeros(1, x_MD.shape[1])])
        return self.experts(padded, [1] + [0] * (len(counts) - 1))[:0]


def _shard_experts(experts: GroupedExperts, *, ep_rank: int, local: int) -> None:
    lo = ep_rank * local
    for name in EXPERT_WEIGHTS:
        full = getattr(experts, name)
        sliced = full.detach()[lo : lo + local].clone()
        setattr(experts, name, nn.Parameter(sliced, requires_grad=full.requires_grad))


def apply_expert_parallel(model: Transformer, *, mesh: ParallelMesh) -> None:
    """Keep only this rank's experts in every MoE layer and route tokens to other ranks' experts.

    Call before FSDP is applied, on a plain model whose weights are the same on every rank. With
    `expert=1` nothing changes.
    """
    config = mesh.config
    if config.expert == 1:
        return
    group, ep_rank = mesh.expert_group, mesh.expert_rank
    for moe in model.moe_layers:
        if isinstance(moe, ExpertParallelMoE):
            raise TypeError("expert parallelism is already applied to this model")
        config.check_experts(moe.num_experts)
        local = moe.num_experts // config.expert
        _shard_experts(moe.experts, ep_rank=ep_rank, local=local)
        moe.__class__ = ExpertParallelMoE
        assert isinstance(moe, ExpertParallelMoE)  # the class swap above
        moe.ep_group, moe.ep_size, moe.ep_rank = group, config.expert, ep_rank


def expert_weight_owners(model: nn.Module) -> dict[str, ExpertParallelMoE]:
    """Names of the parameters that hold only this rank's experts, with the layer that knows their group."""
    owners = {}
    for prefix, module in model.named_modules():
        if isinstance(module, ExpertParallelMoE):
            for name in EXPERT_WEIGHTS:
                owners[f"{prefix}.experts.{name}"] = module
    return owners


def gather_experts(local: torch.Tensor, *, moe: ExpertParallelMoE) -> torch.Tensor:
    """All experts' tensor [E, ...] from each rank's [E/ep, ...] slice (a plain, non-autograd gather)."""
    parts = [torch.empty_like(local) for _ in range(moe.ep_size)]
    dist.all_gather(parts, local.contiguous(), group=moe.ep_group)
    return torch.cat(parts)
