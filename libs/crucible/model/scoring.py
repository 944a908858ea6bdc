"""Log-probabilities of chosen next tokens without the [batch, time, vocabulary] logits.

A trainer needs log pi(token) only where the policy sampled, under the distribution it sampled from
(logits / temperature, restricted to the tokens a grammar allowed). `Scoring` names those positions and
their tokens; `Transformer.forward(..., scoring=...)` gathers the final hidden states there and runs the
output head, the mask, the log-softmax and the pick over chunks of `chunk` positions. Under autograd each
chunk is checkpointed (its logits are recomputed in backward, not kept), so what a forward holds for the
head is one chunk's [chunk, vocabulary] tensors, whatever the batch's length.

Allowed tokens travel packed, 32 to an int32 word (`pack_allowed`), unpacked one chunk at a time: a
step's grammar masks cost V/8 bytes per scored position instead of V.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK = 1024
"""Positions per head chunk: [1024, 49152] fp32 logits are 200 MB."""
_SHIFTS = torch.arange(32, dtype=torch.int32)


def pack_allowed(allowed: torch.Tensor) -> torch.Tensor:
    """Bool [..., V] to int32 [..., ceil(V / 32)]: token 32w + b is bit b of word w."""
    V = allowed.shape[-1]
    words = -(-V // 32)
    padded = F.pad(allowed.to(torch.int64), (0, words * 32 - V)).view(*allowed.shape[:-1], words, 32)
    packed = (padded << _SHIFTS.to(device=allowed.device, dtype=torch.int64)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_allowed(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Int32 [..., W] (`pack_allowed`) back to bool [..., vocab_size]."""
    bits = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


@dataclass(frozen=True)
class Scoring:
    """Which next tokens to score: the hidden state at each True position of `where_BT` [B, T] predicts
    the next token, `targets_N` [N] (N = where_BT.sum(), in row-major order). `allowed_NW` packs the
    tokens allowed at each (None: every token); logits are divided by `temperature` first."""

    where_BT: torch.Tensor
    targets_N: torch.Tensor
    temperature: float = 1.0
    allowed_NW: torch.Tensor | None = None
    entropy: bool = False
    chunk: int = CHUNK

    def __post_init__(self) -> None:
        n = int(self.where_BT.sum())
        if self.targets_N.shape != (n,):
            raise ValueError(
                f"targets_N must have one token per scored position ({n}), got {tuple(self.targets_N.shape)}"
            )
        if self.allowed_NW is not None and self.allowed_NW.shape[0] != n:
            raise ValueError(f"allowed_NW must have one row per scored position ({n})")
        if self.temperature <= 0:
            raise ValueError("temperature must be positive")
        if self.chunk < 1:
            raise ValueError("chunk must be at least 1")


@dataclass(frozen=True)
class Scores:
    logprobs_N: torch.Tensor  # fp32: log pi(target) under the allowed tokens
    entropy_N: torch.Tensor | None  # fp32 entropy of that distribution (Scoring.entropy)


def score(h_BTD: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], scoring: Scoring) -> Scores:
    """Scores of `scoring`'s targets from the final (normed) hidden states and the output head."""
    h_ND = h_BTD[scoring.where_BT]
    picked, entropies = [], []
    for lo in range(0, h_ND.shape[0], scoring.chunk):
        hi = min(lo + scoring.chunk, h_ND.shape[0])
        allowed = None if scoring.allowed_NW is None else scoring.allowed_NW[lo:hi]
        args = (h_ND[lo:hi], scoring.targets_N[lo:hi], allowed)
        run = _chunk(head, scoring.temperature, scoring.entropy)
        logp, ent = checkpoint(run, *args, use_reentrant=False) if torch.is_grad_enabled() else run(*args)
        picked.append(logp)
        entropies.append(ent)
    empty = h_ND.new_zeros(0, dtype=torch.float32)
    return Scores(
        logprobs_N=torch.cat(picked) if picked else empty,
        entropy_N=(torch.cat(entropies) if entropies else empty) if scoring.entropy else None,
    )


def _chunk(head: Callable[[torch.Tensor], torch.Tensor], temperature: float, with_entropy: bool):
    def run(h_CD: torch.Tensor, targets_C: torch.Tensor, allowed_CW: torch.Tensor | None):
        logits = head(h_CD).float() / temperature
        if allowed_CW is not None:
            logits = logits.masked_fill(~unpack_allowed(allowed_CW, logits.shape[-1]), float("-inf"))
        logp = torch.log_softmax(logits, dim=-1)
        picked = logp.gather(-1, targets_C[:, None]).squeeze(-1)
        return picked, entropy_from_logprobs(logp) if with_entropy else picked.new_zeros(0)

    return run


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Entropy of each distribution [..., V] (tokens a constraint forbids have -inf, probability 0)."""
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
