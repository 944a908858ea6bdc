"""Group-relative advantages: each rollout is scored against the other rollouts of the same task."""

from __future__ import annotations

import torch


def group_relative_advantages(rewards_G: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean(r)) / (std(r) + eps) within one group; zeros when every reward is the same.

    `std` is the population standard deviation. With `scale_by_std=False` only the mean is removed, which
    keeps tasks with little reward spread from being amplified.
    """
    if rewards_G.ndim != 1 or rewards_G.numel() < 1:
        raise ValueError(f"expected a 1-D tensor of group rewards, got shape {tuple(rewards_G.shape)}")
    rewards_G = rewards_G.to(torch.float32)
    centered = rewards_G - rewards_G.mean()
    if not scale_by_std:
        return centered
    return centered / (rewards_G.std(unbiased=False) + eps)
