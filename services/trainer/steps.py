"""A run's progress: its step and version, the graded groups its steps take, and each step's order.

A step takes `groups_per_step` ready groups from the ledger, has the planner choose what to train and
with which advantages, trains it in the worker group, then: every `schedule.save_every` steps and at
every published version the state is saved (and the messages trained since the last save acked); the
weight version is published if one is due; the step's report goes out last.
"""

from __future__ import annotations

import asyncio
import time

import torch

from crucible.contracts.events import StepReport
from crucible.contracts.keys import DAY_S, refills_key
from crucible.contracts.runconfig import RunConfig
from crucible.rl.advantages import is_uniform
from crucible.rl.planner import plan_step
from crucible.runtime import Runtime
from services.trainer.group import NonFiniteStep, PolicyGroup
from services.trainer.ledger import Group, Ledger
from services.trainer.metrics import SKIPPED_STEPS, STEP_SECONDS, STEPS, TRAJECTORIES
from services.trainer.publishing import RunPublisher
from services.trainer.settings import Settings
from services.trainer.state import Books, StateStore


class RunFailed(RuntimeError):
    """The run cannot start or go on (the message says why): it ends as failed, never retried."""


class RunSteps:
    def __init__(
        self, *, rt: Runtime[Settings], run_id: str, config: RunConfig, policy: PolicyGroup,
        states: StateStore, out: RunPublisher, books: Books | None,
    ) -> None:  # fmt: skip
        self.rt, self.settings, self.run_id, self.config = rt, rt.settings, run_id, config
        self.policy, self.states, self.out = policy, states, out
        self.step, self.version, self.last_step = (
            (0, -1, None) if books is None else (books.step, books.version, books.last_step)
        )
        self.ledger = Ledger(() if books is None else books.trained)
        self.steps_unsaved = 0
        self.dropped_groups = 0  # uniform-reward groups dropped since the last step
        self.skipped_steps = 0  # steps in a row skipped for non-finite numbers
        self.arrived = asyncio.Event()
        self.last_arrival = time.monotonic()  # of a graded trajectory (or the run's start on this trainer)
        self.last_refill = 0.0  # when groups lost in flight were last replaced

    async def save(self) -> None:
        """Save the state with everything trained so far; then ack what it trained."""
        books = Books(
            step=self.step,
            version=self.version,
            trained=sorted(self.ledger.trained),
            last_step=self.last_step,
        )
        await self.states.save(self.policy.save, books)
        self.steps_unsaved = 0
        await self.ledger.saved()

    async def publish(self) -> None:
        weights = await asyncio.to_thread(self.policy.weights)
        await self.out.publish(version=self.version, step=self.step, weights=weights)

    def arrival(self) -> None:
        self.last_arrival = time.monotonic()
        self.arrived.set()

    async def wait_or_train(self) -> None:
        """Train a step if enough groups are ready; else wait up to a second for more to arrive."""
        schedule = self.config.schedule
        if self.config.optim.drop_uniform_groups:
            await self._drop_uniform_groups()
        ready = self.ledger.ready(
            group_size=schedule.group_size, groups_per_step=schedule.groups_per_step,
            timeout_s=self.settings.group_timeout_s,
        )  # fmt: skip
        if len(ready) == schedule.groups_per_step:
            await self._train(self.ledger.begin_step(ready))
            return
        waited = time.monotonic() - self.last_arrival
        if waited > self.settings.stall_timeout_s:
            raise RunFailed(f"no graded trajectory came for {waited:.0f} s: the run cannot progress")
        await self._replace_lost_groups(len(ready), waited)
        self.arrived.clear()
        try:
            await asyncio.wait_for(self.arrived.wait(), timeout=1.0)
        except TimeoutError:
            pass

    async def _train(self, groups: list[Group]) -> None:
        started = time.perf_counter()
        plan = plan_step([g.graded for g in groups], version=self.version, step=self.step, config=self.config)
        TRAJECTORIES.labels(self.run_id, "stale").inc(len(plan.stale))
        TRAJECTORIES.labels(self.run_id, "alone").inc(len(plan.alone))
        if not plan.kept:
            self.rt.log.warning(
                "no trainable trajectories in these groups", run_id=self.run_id, stale=len(plan.stale)
            )
            await self.ledger.step_untrained()
            return
        trained = [g.trajectory.trajectory_id for g in plan.kept]
        try:
            if plan.non_finite:
                raise NonFiniteStep(plan.non_finite)
            trajectories = [g.trajectory for g in plan.kept]
            metrics = await asyncio.to_thread(self.policy.train, trajectories, plan.advantages)
        except NonFiniteStep as exc:
            await self._skip_step(exc, trained, groups=len(groups))
            return
        self.step += 1
        self.ledger.step_trained(trained)
        STEPS.labels(self.run_id).inc()
        TRAJECTORIES.labels(self.run_id, "trained").inc(len(trained))
        metrics |= plan.metrics | {
            "groups_dropped": float(self.dropped_groups),
            "groups_dropped_fraction": self.dropped_groups / (self.dropped_groups + len(groups)),
            "skipped_steps": float(self.skipped_steps),
            "step_seconds": time.perf_counter() - started,
            "world_size": float(self.config.parallel.world_size),  # ranks that took the step
        }
        self.dropped_groups = self.skipped_steps = 0
        STEP_SECONDS.observe(metrics["step_seconds"])
        self.last_step = StepReport(
            step=self.step,
            version=self.version,  # the version the batch trained against
            trajectory_ids=trained,
            dropped_stale_ids=plan.stale,
            dropped_alone_ids=plan.alone,
            metrics=metrics,
        )
        publish = self.step % self.config.schedule.publish_every == 0
        if publish:
            self.version += 1
        self.steps_unsaved += 1
        if publish or self.steps_unsaved >= self.config.schedule.save_every:
            await self.save()
        if publish:
            await self.publish()
        await self.out.event(self.last_step)
        self.rt.log.info(
            "step", run_id=self.run_id, step=self.step, **{k: round(v, 4) for k, v in metrics.items()}
        )

    async def _skip_step(self, exc: NonFiniteStep, trajectory_ids: list[str], *, groups: int) -> None:
        """A step whose numbers are not finite is not taken: nothing is trained, saved or published, its
        trajectories are acked untrained (they would fail again) and as many groups are asked for again;
        after `max_nonfinite_steps` such steps in a row the run fails with the reason."""
        self.skipped_steps += 1
        SKIPPED_STEPS.labels(self.run_id, exc.reason).inc()
        TRAJECTORIES.labels(self.run_id, "non_finite").inc(len(trajectory_ids))
        self.rt.log.error("step skipped", run_id=self.run_id, reason=exc.reason, in_a_row=self.skipped_steps,
                          trajectories=trajectory_ids[:8])  # fmt: skip
        await self.ledger.step_untrained()
        await self._refill(groups)
        limit = self.settings.max_nonfinite_steps
        if self.skipped_steps >= limit:
            raise RunFailed(
                f"{self.skipped_steps} steps in a row had non-finite {exc.reason} (limit {limit})"
            )

    async def _drop_uniform_groups(self) -> None:
        """DAPO's dynamic sampling: a complete group whose rewards are all equal carries no signal; it is
        acked untrained, and the rollouts are told to admit one more group in its place."""
        for gid in self.ledger.complete(self.config.schedule.group_size):
            if is_uniform(torch.tensor([g.reward.total for g in self.ledger.groups[gid].graded])):
                TRAJECTORIES.labels(self.run_id, "uniform").inc(await self.ledger.drop(gid))
                self.dropped_groups += 1
                await self._refill(1)

    async def _replace_lost_groups(self, ready: int, waited: float) -> None:
        """Nothing came for `group_timeout_s`: groups were lost in flight (a rollout replica or its
        sandbox died mid-group, and its admissions died with it). Ask for as many more as the step
        lacks, at most once per `group_timeout_s`, so that lost groups never exhaust the run's budget."""
        timeout = self.settings.group_timeout_s
        if waited < timeout or time.monotonic() - self.last_refill < timeout:
            return
        self.last_refill = time.monotonic()
        missing = self.config.schedule.groups_per_step - ready
        self.rt.log.warning("no graded work; replacing groups lost in flight", run_id=self.run_id,
                            groups=missing, waited_s=round(waited))  # fmt: skip
        await self._refill(missing)

    async def _refill(self, groups: int) -> None:
        """Tell the rollouts to admit `groups` more groups in place of groups that will never be trained."""
        key = refills_key(self.run_id)
        try:
            async with self.rt.redis.pipeline(transaction=True) as pipe:
                pipe.incrby(key, groups)
                pipe.expire(key, DAY_S)
                await pipe.execute()
        except Exception as exc:  # Redis is coordination only: the run may then admit fewer groups
            self.rt.log.warning("could not ask for a refill", run_id=self.run_id, error=repr(exc))
