"""Clipped policy-gradient loss with an importance correction against the behaviour policy.

Tokens were sampled by a behaviour policy (the rollout's weights, possibly several versions old). The
loss is PPO's clipped surrogate on the ratio pi_theta / pi_behaviour, so stale tokens are corrected by
importance weighting and the update is bounded; the ratio is additionally capped from above for
negative advantages (dual clip) so that a very unlikely stale token cannot produce an unbounded step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossStats:
    loss: torch.Tensor
    clip_fraction: float
    ratio_mean: float
    ratio_max: float
    approx_kl: float
    tokens: int


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    denom = mask.sum()
    if denom == 0:
        return (x * 0).sum()
    return (x * mask).sum() / denom


def clipped_policy_loss(
    *,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    dual_clip: float = 3.0,
) -> LossStats:
    """Token-level clipped surrogate, averaged over the masked tokens.

    logprobs: log pi_theta(token) with grad, [N]; behaviour_logprobs: recorded at sampling time, [N];
    advantages: per token (the trajectory's advantage broadcast), [N]; mask: 1 where the policy sampled.
    """
    if not (logprobs.shape == behaviour_logprobs.shape == advantages.shape == mask.shape):
        raise ValueError("logprobs, behaviour_logprobs, advantages and mask must have one shape")
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - behaviour_logprobs.detach()
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    # Dual clip: for A < 0, never let the objective fall below dual_clip * A.
    surrogate = torch.where(advantages < 0, torch.maximum(surrogate, dual_clip * advantages), surrogate)
    loss = -masked_mean(surrogate, mask)
    with torch.no_grad():
        selected = mask > 0
        was_clipped = (torch.abs(ratio - 1.0) > clip_eps) & selected
        n = int(selected.sum())
        ratios = ratio[selected]
        return LossStats(
            loss=loss,
            clip_fraction=float(was_clipped.sum()) / max(n, 1),
            ratio_mean=float(ratios.mean()) if n else 1.0,
            ratio_max=float(ratios.max()) if n else 1.0,
            approx_kl=float(masked_mean((ratio - 1) - log_ratio, mask)),
            tokens=n,
        )
