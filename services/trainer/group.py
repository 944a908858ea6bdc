"""A run's worker group, from the trainer's side: the only way the trainer service optimises a policy.

`PolicyGroup` starts the run's ranks (`parallel` in its config: world size, mesh, `local` processes or
`ray` actors) with a `PolicyRank` each, cuts every step's trajectories into one slice per rank, and
turns the ranks' answers into one step's metrics. Its calls block (the job runs them in a thread). A
rank that fails or dies breaks the group (`WorkerGroupError`): the run's job fails that attempt and
resumes from the last saved state in a fresh group.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from crucible.contracts.messages import Trajectory
from crucible.contracts.runconfig import RunConfig
from crucible.model.spec import PolicySpec
from crucible.parallel import WorkerGroup, start_workers
from crucible.rl.losses import BatchTotals
from services.trainer.batch import collate
from services.trainer.policy import PolicyRank, Slice

if TYPE_CHECKING:
    import torch


class NonFiniteStep(ArithmeticError):
    """The step's rewards, advantages, loss or gradients are not finite: nothing was applied (weights,
    optimizer state and router biases are as before the step). `reason` names what was not finite."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"non-finite {reason}: the step was not applied")
        self.reason = reason


SUMMED = {"tokens", "rows_skipped"}
MAXED = {"ratio_max"}
SAME = {"loss", "grad_norm"}  # already global: every rank returns the same value


def combine(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from the ranks': loss and gradient norm are global already, token counts add
    up, maxima are maxima, and every other metric (fractions, means, ratio quantiles) is the token-weighted
    mean of the ranks' values: exact for fractions and means, an approximation for quantiles."""
    out = {}
    for key in dict.fromkeys(k for r in per_rank for k in r):  # every rank's keys, in order
        # a rank without a metric ran nothing it describes
        values = [(r[key], r.get("tokens", 0.0)) for r in per_rank if key in r]
        tokens = sum(w for _, w in values)
        if key in SAME:
            out[key] = values[0][0]
        elif key in SUMMED:
            out[key] = sum(v for v, _ in values)
        elif key in MAXED:
            out[key] = max(v for v, _ in values)
        elif tokens > 0:
            out[key] = sum(v * w for v, w in values) / tokens
        else:
            out[key] = values[0][0]
    return out


def slices(trajectories: list[Trajectory], advantages: list[float], *, world_size: int) -> list[Slice]:
    """A step's trajectories cut into contiguous, near-equal runs, one per rank, each with the whole
    batch's counts. A rank left without one still runs the step (its peers wait for it in every
    collective) on a copy of the first trajectory that counts nowhere: no sampled token, no valid position."""
    bounds = [len(trajectories) * r // world_size for r in range(world_size + 1)]
    batches = [
        collate(trajectories[lo:hi], advantages[lo:hi]) if hi > lo else None
        for lo, hi in itertools.pairwise(bounds)
    ]
    real = [b for b in batches if b is not None]
    totals = BatchTotals(
        tokens=sum(float(b.mask_BT.sum()) for b in real),
        sequences=sum(float((b.mask_BT.sum(-1) > 0).sum()) for b in real),
        rows=len(trajectories),
    )
    parts = []
    for batch in batches:
        if batch is None:
            batch = collate(trajectories[:1], [0.0]).filler()
        parts.append(Slice(batch=batch, totals=totals))
    return parts


def step_metrics(per_rank: list[dict[str, float | str]]) -> dict[str, float]:
    """The ranks' answers to one step as its metrics; raises NonFiniteStep when they skipped it."""
    skipped = per_rank[0].get("skipped")
    if isinstance(skipped, str):
        raise NonFiniteStep(skipped)
    return combine([{k: float(v) for k, v in r.items()} for r in per_rank])


class PolicyGroup:
    """The run's ranks, driven through typed calls; every call blocks until each rank has answered."""

    def __init__(
        self,
        config: RunConfig,
        *,
        timeout_s: float,
        threads: int | None = None,
        ray_address: str = "",
        spec: PolicySpec | None = None,
        rank: type[PolicyRank] = PolicyRank,
    ) -> None:
        """`threads`: torch threads per local rank (default: this machine's cores shared among the ranks);
        `spec`: the run's policy, resolved (default: from `config`); `rank`: the class every rank builds
        (tests pass a subclass they can look into)."""
        parallel = config.parallel
        self.world_size, self.launcher = parallel.world_size, parallel.launcher
        self.workers: WorkerGroup[PolicyRank] = start_workers(
            rank,
            args=(config, spec or PolicySpec.resolve(config)),
            world_size=parallel.world_size,
            launcher=parallel.launcher,
            backend=None if parallel.backend == "auto" else parallel.backend,
            timeout_s=timeout_s,
            threads_per_process=threads,
            preload=("services.trainer.policy",),
            ray_address=ray_address or None,
            keep_ray=True,
        )

    def train(self, trajectories: list[Trajectory], advantages: list[float]) -> dict[str, float]:
        """One RL step over the whole group; raises NonFiniteStep when it was skipped."""
        parts = slices(trajectories, advantages, world_size=self.world_size)
        return step_metrics(self.workers.call_each(PolicyRank.train, [((p,), {}) for p in parts]))

    def sft(self, trajectories: list[Trajectory], *, learning_rate: float) -> dict[str, float]:
        parts = slices(trajectories, [0.0] * len(trajectories), world_size=self.world_size)
        return step_metrics(self.workers.call_each(PolicyRank.sft, [((p, learning_rate), {}) for p in parts]))

    def end_sft(self) -> None:
        self.workers.call(PolicyRank.end_sft)

    def weights(self) -> dict[str, torch.Tensor]:
        state = self.workers.call(PolicyRank.weights)[0]
        assert state is not None  # rank 0 holds the gathered weights
        return state

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        self.workers.call(PolicyRank.load_weights, state)

    def set_reference(self, state: dict[str, torch.Tensor]) -> None:
        self.workers.call(PolicyRank.set_reference, state)

    def save(self, directory: str) -> None:
        self.workers.call(PolicyRank.save, directory)

    def load(self, directory: str) -> None:
        self.workers.call(PolicyRank.load, directory)

    def close(self) -> None:
        self.workers.close()
