"""Building blocks: precision-aware linear, RMSNorm, SwiGLU feed-forward, rotary embeddings, embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from crucible.model.matmul import linear


class Linear(nn.Module):
    """Bias-free linear layer whose matmul precision is set from outside (`precision` attribute)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.precision = "fp32"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, precision=self.precision)


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
    """cos and sin [max_seq_len, head_dim // 2] in fp32, computed in fp64."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x_BTHd: torch.Tensor, cos_Th: torch.Tensor, sin_Th: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head's features by position-dependent angles."""
    x1, x2 = x_BTHd.chunk(2, dim=-1)
    cos, sin = cos_Th[None, :, None, :], sin_Th[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
