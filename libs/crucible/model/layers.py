"""Building blocks: precision-aware linear, RMSNorm, SwiGLU feed-forward, rotary embeddings, embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from crucible.model.matmul import linear


class Linear(nn.Module):
    """Linear layer whose matmul precision is set from outside (`precision` attribute); bias-free unless
    asked (Qwen2's attention projections), the bias added in fp32. `crucible.model.lora.attach` may give
    it adapters (`lora`, by projection) over the row ranges `parts` names."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.precision = "fp32"
        self.lora: nn.ModuleDict | None = None
        self.parts: tuple[tuple[str, int], ...] = ()  # (projection, rows), in row order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, precision=self.precision)
        if self.lora is not None:
            y = y + self._adapted(x).to(y.dtype)
        return y if self.bias is None else y.float() + self.bias

    def _adapted(self, x: torch.Tensor) -> torch.Tensor:
        assert self.lora is not None
        if len(self.parts) == 1:
            return self.lora[self.parts[0][0]](x)
        outs = {name: self.lora[name](x) for name, _ in self.parts if name in self.lora}
        like = next(iter(outs.values()))
        zeros = lambda rows: like.new_zeros(*like.shape[:-1], rows)  # noqa: E731  # a part not adapted
        return torch.cat([outs[name] if name in outs else zeros(rows) for name, rows in self.parts], dim=-1)


class Embedding(nn.Module):
    """Token embedding, always looked up in fp32."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden_dim)
        self.w2 = Linear(hidden_dim, dim)
        self.w3 = Linear(dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def rotary_tables(*, head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [max_seq_len, head_dim] in fp32 (computed in fp64) for `apply_rotary`.

    Feature i is paired with feature i + head_dim/2; both halves use the same angles, and the sin
    table carries the minus sign of the first half so rotation is two products and a sum.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1).float(), torch.cat([-sin, sin], dim=-1).float()


def apply_rotary(x_BTHd: torch.Tensor, cos_Td: torch.Tensor, sin_Td: torch.Tensor) -> torch.Tensor:
    """Rotate each (x[i], x[i + d/2]) pair of every head by its position's angle; returns fp32. The tables
    are [T, d] (every row at the same positions) or [B, T, d] (each row at its own)."""
    half = x_BTHd.shape[-1] // 2
    swapped = torch.cat([x_BTHd[..., half:], x_BTHd[..., :half]], dim=-1)
    return x_BTHd * cos_Td.unsqueeze(-2) + swapped * sin_Td.unsqueeze(-2)
