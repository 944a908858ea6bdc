"""Advantages: each rollout is scored against the other rollouts of the same task (its group).

- `grpo`:    (r - mean(r)) / (std(r) + eps), population or sample std (GRPO).
- `dr_grpo`: r - mean(r), no std normalisation (Dr. GRPO): tasks with little reward spread are not
             amplified.
- `rloo`:    r_i - mean of the other members (REINFORCE leave-one-out) = G / (G - 1) * (r_i - mean(r)).

A group whose rewards are all equal gets zero advantages under every estimator (no signal), and so
does a group of one.
"""

from __future__ import annotations

from typing import Literal

import torch

Estimator = Literal["grpo", "dr_grpo", "rloo"]
Std = Literal["population", "sample"]


def _check(rewards_G: torch.Tensor) -> torch.Tensor:
    if rewards_G.ndim != 1 or rewards_G.numel() < 1:
        raise ValueError(f"expected a 1-D tensor of group rewards, got shape {tuple(rewards_G.shape)}")
    return rewards_G.to(torch.float32)


def grpo_advantages(rewards_G: torch.Tensor, *, std: Std = "population", eps: float = 1e-6) -> torch.Tensor:
    rewards_G = _check(rewards_G)
    centered = rewards_G - rewards_G.mean()
    if rewards_G.numel() == 1:
        return centered
    spread = rewards_G.std(unbiased=std == "sample")
    return centered / (spread + eps)


def dr_grpo_advantages(rewards_G: torch.Tensor) -> torch.Tensor:
    rewards_G = _check(rewards_G)
    return rewards_G - rewards_G.mean()


def rloo_advantages(rewards_G: torch.Tensor) -> torch.Tensor:
    rewards_G = _check(rewards_G)
    n = rewards_G.numel()
    if n == 1:
        return torch.zeros_like(rewards_G)
    others_mean = (rewards_G.sum() - rewards_G) / (n - 1)
    return rewards_G - others_mean


def group_advantages(
    rewards_G: torch.Tensor, *, estimator: Estimator = "grpo", std: Std = "population", eps: float = 1e-6
) -> torch.Tensor:
    """One group's advantages under the chosen estimator."""
    if estimator == "grpo":
        return grpo_advantages(rewards_G, std=std, eps=eps)
    if estimator == "dr_grpo":
        return dr_grpo_advantages(rewards_G)
    if estimator == "rloo":
        return rloo_advantages(rewards_G)
    raise ValueError(f"unknown advantage estimator {estimator!r}")


def is_uniform(rewards_G: torch.Tensor) -> bool:
    """All rewards equal: the group carries no learning signal (DAPO's dynamic sampling drops it)."""
    return bool((rewards_G == rewards_G[0]).all())
