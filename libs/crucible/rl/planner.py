"""The step planner: which graded trajectories of a step's groups are trained, with which advantages.

A pure function of the groups, the trainer's version and step, and the run config: no bus, no model, no
clock. A trajectory whose oldest sampled token lags the trainer by more than `schedule.max_staleness`
versions is dropped as stale; a group left with fewer than two members has no baseline and is dropped
as alone; every other group gets the run's group-relative advantages. The plan's metrics describe the
kept trajectories (rewards, staleness, tokens per episode by part). Rewards or advantages that are
not finite make the step one to skip (`non_finite` names which), never one to train.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from crucible.contracts.messages import TOKEN_PARTS, GradedTrajectory, Trajectory
from crucible.contracts.runconfig import RunConfig
from crucible.contracts.trajectories import arrays
from crucible.rl.advantages import group_advantages
from crucible.rl.staleness import staleness


@dataclass(frozen=True)
class StepPlan:
    kept: list[GradedTrajectory]  # in the order of their groups
    advantages: list[float]  # one per kept trajectory
    stale: list[str] = field(default_factory=list)  # trajectory ids dropped for staleness
    alone: list[str] = field(default_factory=list)  # dropped: their group kept fewer than two
    non_finite: str | None = None  # "rewards" or "advantages": the step must be skipped
    metrics: dict[str, float] = field(default_factory=dict)  # the planned batch's, empty when none is kept


def plan_step(
    groups: Sequence[Sequence[GradedTrajectory]], *, version: int, step: int, config: RunConfig
) -> StepPlan:
    """Plan one optimizer step taken at trainer `version` after `step` steps."""
    schedule, optim = config.schedule, config.optim
    kept: list[GradedTrajectory] = []
    advantages: list[float] = []
    stale: list[str] = []
    alone: list[str] = []
    lags: list[int] = []
    ages: list[int] = []
    for group in groups:
        members = []  # (graded, lag, age) of the group's fresh members
        for graded in group:
            sampled = arrays(graded.trajectory).sampled_versions.tolist()
            lag = staleness(trainer_version=version, token_versions=sampled)
            if lag > schedule.max_staleness:
                stale.append(graded.trajectory.trajectory_id)
                continue
            # optimizer steps since the oldest sampled token's version was published
            age = step - min(sampled, default=version) * schedule.publish_every
            members.append((graded, lag, age))
        if len(members) < 2:  # a group-relative advantage needs a baseline to compare against
            alone.extend(g.trajectory.trajectory_id for g, _, _ in members)
            continue
        rewards = torch.tensor([g.reward.total for g, _, _ in members])
        advantages.extend(
            group_advantages(
                rewards, estimator=optim.advantage, std=optim.advantage_std, eps=optim.advantage_eps
            ).tolist()
        )
        kept.extend(g for g, _, _ in members)
        lags.extend(lag for _, lag, _ in members)
        ages.extend(age for _, _, age in members)
    if not kept:
        return StepPlan(kept=[], advantages=[], stale=stale, alone=alone)
    rewards_all = [g.reward.total for g in kept]
    non_finite = None
    if not all(map(math.isfinite, rewards_all)):
        non_finite = "rewards"
    elif not all(map(math.isfinite, advantages)):
        non_finite = "advantages"
    metrics = {
        "reward_mean": sum(rewards_all) / len(kept),
        "resolved_rate": sum(g.reward.resolved for g in kept) / len(kept),
        "reward_max": max(rewards_all),
        "staleness_mean": sum(lags) / len(lags),
        "staleness_max": float(max(lags)),
        "token_age_steps_max": float(max(ages)),
        "trajectories": float(len(kept)),
        "stale_dropped": float(len(stale)),
        **{f"staleness_lag_{lag}": float(lags.count(lag)) for lag in range(max(lags) + 1)},
        **token_usage_means([g.trajectory for g in kept]),
    }
    return StepPlan(
        kept=kept, advantages=advantages, stale=stale, alone=alone, non_finite=non_finite, metrics=metrics
    )


def token_usage_means(trajectories: list[Trajectory]) -> dict[str, float]:
    """Mean tokens per episode on each part (tokens_system, tokens_task, tokens_observations,
    tokens_actions), over the trajectories that record it."""
    usages = [t.token_usage for t in trajectories if t.token_usage is not None]
    if not usages:
        return {}
    return {f"tokens_{part}": sum(getattr(u, part) for u in usages) / len(usages) for part in TOKEN_PARTS}
