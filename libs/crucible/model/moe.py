"""Mixture-of-Experts feed-forward: fp32 router with loss-free load balancing and replay, grouped experts.

Parallelism is applied from outside through two seams:
- `MoE.dispatch(x_ND, ids_NK, weights_NK) -> y_ND` moves tokens to their experts and combines the
  results; an expert-parallel wrapper replaces it with an all-to-all version.
- `GroupedExperts.forward(x_MD, counts)` runs the experts on rows already sorted by expert; its
  weights are single [experts, ...] tensors that can be sharded along the expert dimension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from crucible.model.config import ModelConfig
from crucible.model.layers import FeedForward
from crucible.model.matmul import gathered_linear, grouped_linear


class Router(nn.Module):
    """Top-k router in fp32, sigmoid-scored (DeepSeek-V3 style) or softmax-scored over all experts
    (Qwen3-MoE, Mixtral, OLMoE); with `norm_topk_prob` the chosen experts' weights are renormalised to
    sum to one, and every weight is then multiplied by `route_scale`.

    A per-expert bias (`expert_bias`, saved with the weights) is added to the scores only to choose the
    experts, never to weight them; `update_bias` nudges it against the load observed in training
    (`tokens_per_expert`), which balances experts without an auxiliary loss. Only real tokens count in
    that load: padding positions of a batch, passed as `valid_N` == 0, are routed but not counted. Under
    data or expert parallelism, sum `tokens_per_expert` across ranks before calling `update_bias`.
    """

    expert_bias: torch.Tensor  # buffers (register_buffer)
    tokens_per_expert: torch.Tensor

    def __init__(
        self,
        dim: int,
        *,
        num_experts: int,
        top_k: int,
        route_scale: float,
        scoring: str = "sigmoid",
        norm_topk_prob: bool = True,
        n_group: int = 1,
        topk_group: int = 1,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.route_scale = num_experts, top_k, route_scale
        self.scoring, self.norm_topk_prob = scoring, norm_topk_prob
        self.n_group, self.topk_group = n_group, topk_group
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        self.counting = True  # off while a checkpointed block is recomputed (its load is counted once)

    def forward(
        self,
        x_ND: torch.Tensor,
        replay_NK: torch.Tensor | None = None,
        valid_N: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids [N, k] and their combine weights [N, k] (fp32).

        With `replay_NK`, those expert ids are used instead of the router's own choice, except rows
        marked -1, which are routed afresh. Weights always come from the current router scores. In
        training, each row's k choices add to `tokens_per_expert`, except rows where `valid_N` is 0
        (padding); without `valid_N` every row counts.
        """
        logits = F.linear(x_ND.float(), self.weight.float())
        scores = torch.sigmoid(logits) if self.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores.detach() + self.expert_bias
        if self.n_group > 1:  # only within the topk_group groups whose two best experts score highest
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(
                1, best.topk(self.topk_group, dim=-1).indices, True
            )
            choice = choice.masked_fill(
                ~keep.repeat_interleave(self.num_experts // self.n_group, dim=1), float("-inf")
            )
        ids = torch.topk(choice, self.top_k, dim=-1).indices
        if replay_NK is not None:
            ids = torch.where(replay_NK[:, :1] >= 0, replay_NK, ids)
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * self.route_scale
        if self.training and self.counting:
            with torch.no_grad():
                E, flat = self.num_experts, ids.flatten()
                if valid_N is not None:  # padding rows go to an extra bin E, dropped below
                    real = (valid_N != 0).repeat_interleave(self.top_k)
                    flat = torch.where(real, flat, torch.full_like(flat, E))
                self.tokens_per_expert += torch.bincount(flat, minlength=E + 1)[:E].float()
        return ids, weights

    @torch.no_grad()
    def update_bias(self, *, rate: float) -> None:
        """Raise the bias of under-loaded experts and lower it for over-loaded ones; reset the counts."""
        load = self.tokens_per_expert
        if load.sum() > 0:
            self.expert_bias += rate * torch.sign(load.mean() - load)
        load.zero_()


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts stored as grouped tensors w1_EFD, w3_EFD (gate, up) and w2_EDF (down)."""

    def __init__(self, dim: int, hidden_dim: int, *, num_experts: int) -> None:
        super().__init__()
        self.w1_EFD = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3_EFD = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.precision = "fp32"

    def forward(self, x_MD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows of x sorted by expert, `counts[e]` rows for local expert e."""
        p = self.precision
        h = F.silu(grouped_linear(x_MD, self.w1_EFD, counts, precision=p))
        h = h * grouped_linear(x_MD, self.w3_EFD, counts, precision=p)
        return grouped_linear(h, self.w2_EDF, counts, precision=p)

    def forward_rows(self, x_MD: torch.Tensor, expert_M: torch.Tensor) -> torch.Tensor:
        """Each row through its own expert `expert_M[m]`, gathering weights (few rows; not mxfp8)."""
        p = self.precision
        h = F.silu(gathered_linear(x_MD, self.w1_EFD, expert_M, precision=p))
        h = h * gathered_linear(x_MD, self.w3_EFD, expert_M, precision=p)
        return gathered_linear(h, self.w2_EDF, expert_M, precision=p)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.router = Router(
            cfg.dim,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            route_scale=cfg.route_scale,
            scoring=cfg.router_scoring,
            norm_topk_prob=cfg.norm_topk_prob,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
        )
        self.experts = GroupedExperts(cfg.dim, cfg.expert_dim, num_experts=cfg.num_experts)
        self.shared_expert = FeedForward(cfg.dim, cfg.shared_expert_dim) if cfg.shared_expert_dim else None

    def forward(
        self,
        x_BTD: torch.Tensor,
        replay_BTK: torch.Tensor | None = None,
        valid_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output [B, T, D] and the expert ids used [B, T, k]; `valid_BT` (0 at padding) as for the router."""
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        replay_NK = None if replay_BTK is None else replay_BTK.reshape(B * T, self.top_k)
        valid_N = None if valid_BT is None else valid_BT.reshape(B * T)
        ids_NK, weights_NK = self.router(x_ND, replay_NK, valid_N)
        y_ND = self.dispatch(x_ND, ids_NK, weights_NK)
        if self.shared_expert is not None:
            y_ND = y_ND + self.shared_expert(x_ND)
        return y_ND.view(B, T, D), ids_NK.view(B, T, self.top_k)

    def dispatch(self, x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        """Send each token to its k experts and return the weighted sum of their outputs [N, D]."""
        N, K = ids_NK.shape
        flat = ids_NK.flatten()
        if self._gather_experts(x_ND, N * K):
            y_flat = self.experts.forward_rows(x_ND.repeat_interleave(K, dim=0), flat)
            return (y_flat.view(N, K, -1) * weights_NK.unsqueeze(-1)).sum(dim=1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        y_sorted = self.experts(x_ND[order // K], counts)
        y_flat = torch.empty_like(y_sorted)
        y_flat[order] = y_sorted
        return (y_flat.view(N, K, -1) * weights_NK.unsqueeze(-1)).sum(dim=1)

    def _gather_experts(self, x_ND: torch.Tensor, slots: int) -> bool:
        """CPU decoding of a few tokens: gathering each slot's expert weights beats sorting into groups
        (op overhead dominates there; on GPUs the grouped kernel reads each expert once instead)."""
        return (
            slots <= self.num_experts
            and x_ND.device.type == "cpu"
            and self.experts.precision != "mxfp8"
            and not torch.is_grad_enabled()
        )
