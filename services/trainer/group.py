"""A run's worker group, from the trainer's side: the only way the trainer service optimises a policy.

`PolicyGroup` starts the run's ranks (`parallel` in its config: world size, mesh, `local` processes or
`ray` actors) with a `PolicyRank` each, cuts every step's trajectories into one slice per rank, and
turns the ranks' answers into one step's metrics. Its calls block (the job runs them in a thread). A
rank that fails or dies breaks the group (`WorkerGroupError`): the run's job fails that attempt and
resumes from the last saved state in a fresh group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from crucible.contracts.messages import Trajectory
from crucible.contracts.runconfig import RunConfig
from crucible.parallel import start_workers
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


SUMMED = {"tokens"}
MAXED = {"ratio_max"}
SAME = {"loss", "grad_norm"}  # already global: every rank returns the same value


def combine(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from the ranks': loss and gradient norm are global already, token counts add
    up, maxima are maxima, and every other metric (fractions, means, ratio quantiles) is the token-weighted
    mean of the ranks' values: exact for fractions and means, an approximation for quantiles."""
    weights = [r.get("tokens", 0.0) for r in per_rank]
    total = sum(weights)
    out = {}
    for key in per_rank[0]:
        values = [r[key] for r in per_rank if key in r]
        if key in SAME or len(values) != len(per_rank):
            out[key] = per_rank[0][key]
        elif key in SUMMED:
            out[key] = sum(values)
        elif key in MAXED:
            out[key] = max(values)
        elif total > 0:
            out[key] = sum(v * w for v, w in zip(values, weights)) / total
        else:
            out[key] = values[0]
    return out


class PolicyGroup:
    def __init__(
        self,
        config: RunConfig,
        *,
        timeout_s: float,
        threads: int | None = None,
        ray_address: str = "",
        rank: type[PolicyRank] = PolicyRank,
    ) -> None:
        """`threads`: torch threads per local rank (default: this machine's cores shared among the ranks);
        `rank`: the class every rank builds (tests pass a subclass they can look into)."""
        parallel = config.parallel
        self.world_size, self.launcher = parallel.world_size, parallel.launcher
        self.workers = start_workers(
            rank,
            args=(config,),
            world_size=parallel.world_size,
            launcher=parallel.launcher,
            backend=None if parallel.backend == "auto" else parallel.backend,
            timeout_s=timeout_s,
            threads_per_process=threads,
            preload=("services.trainer.policy",),
            ray_address=ray_address or None,
            keep_ray=True,
        )

    def slices(self, trajectories: list[Trajectory], advantages: list[float]) -> list[Slice]:
        """Contiguous, near-equal runs of trajectories, one per rank. A rank left without one still runs
        the step (its peers wait for it in every collective) on a copy of the first trajectory that
        counts nowhere: no sampled token, no valid position."""
        ranks = self.world_size
        bounds = [len(trajectories) * r // ranks for r in range(ranks + 1)]
        batches = [
            collate(trajectories[lo:hi], advantages[lo:hi]) if hi > lo else None for lo, hi in zip(bounds, bounds[1:])
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
                batch = collate(trajectories[:1], [0.0])
                batch.mask_BT.zero_()
                batch.valid_BT.zero_()
            parts.append(Slice(batch=batch, totals=totals))
        return parts

    def train(self, trajectories: list[Trajectory], advantages: list[float]) -> dict[str, float]:
        """One RL step over the whole group; raises NonFiniteStep when it was skipped."""
        return self._step(self.workers.call_each("train", [(p,) for p in self.slices(trajectories, advantages)]))

    def sft(self, trajectories: list[Trajectory], *, learning_rate: float) -> dict[str, float]:
        parts = self.slices(trajectories, [0.0] * len(trajectories))
        return self._step(self.workers.call_each("sft", [(p, learning_rate) for p in parts]))

    @staticmethod
    def _step(per_rank: list[dict]) -> dict[str, float]:
        if skipped := per_rank[0].get("skipped"):
            raise NonFiniteStep(skipped)
        return combine(per_rank)

    def end_sft(self) -> None:
        self.workers.call("end_sft")

    def weights(self) -> dict[str, torch.Tensor]:
        return self.workers.call("weights")[0]

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        self.workers.call("load_weights", state)

    def set_reference(self, state: dict[str, torch.Tensor]) -> None:
        self.workers.call("set_reference", state)

    def save(self, directory: str) -> None:
        self.workers.call("save", directory)

    def load(self, directory: str) -> None:
        self.workers.call("load", directory)

    def close(self) -> None:
        self.workers.close()
