"""One training run: consume graded groups, take optimizer steps, publish weight versions.

Graded trajectories are held (not acked) until the step that trains on them has run, so a trainer that
dies loses nothing: JetStream redelivers what was held, and the run resumes from the state saved with
the last published version. Acked means trained, which makes "trained at most once" hold.
"""

from __future__ import annotations

import asyncio
import io
import time
from dataclasses import dataclass, field

import torch

from crucible.bus import Delivery
from crucible.clients.checkpoints import publish_weights
from crucible.contracts import subjects
from crucible.coordination import finished_key
from crucible.contracts.messages import Event, GradedTrajectory, RunCreated
from crucible.contracts.packing import unpack
from crucible.model import PRESETS, build_model
from crucible.objectstore import ObjectNotFound
from crucible.rl.advantages import group_relative_advantages
from crucible.rl.staleness import staleness
from crucible.runtime import Runtime
from services.trainer.batch import collate
from services.trainer.settings import Settings
from services.trainer.step import train_step


@dataclass
class Group:
    members: dict[str, tuple[GradedTrajectory, Delivery]] = field(default_factory=dict)
    first_seen: float = field(default_factory=time.monotonic)


class RunJob:
    def __init__(self, *, rt: Runtime, created: RunCreated) -> None:
        self.rt = rt
        self.settings: Settings = rt.settings  # type: ignore[assignment]
        self.run_id = created.run_id
        self.config = created.config
        self.model = build_model(PRESETS[self.config.model_preset], precision=self.config.precision, seed=self.config.seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.learning_rate, weight_decay=0.0)
        self.step = 0
        self.version = -1
        self.groups: dict[str, Group] = {}
        self.arrived = asyncio.Event()
        self.stop_consuming = asyncio.Event()

    @property
    def state_key(self) -> str:
        return f"runs/{self.run_id}/trainer/state.pt"

    async def _resume(self) -> None:
        try:
            data = await self.rt.store.get_bytes(self.rt.store.uri(self.state_key), verify=False)
        except ObjectNotFound:
            return
        state = torch.load(io.BytesIO(data), weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.version = int(state["step"]), int(state["version"])
        self.rt.log.info("resumed run", run_id=self.run_id, step=self.step, version=self.version)

    async def _publish_version(self) -> None:
        version = self.version + 1
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        await publish_weights(
            bus=self.rt.bus, store=self.rt.store, run_id=self.run_id, version=version, step=self.step, state_dict=state
        )
        buffer = io.BytesIO()
        torch.save(
            {"model": state, "optimizer": self.optimizer.state_dict(), "step": self.step, "version": version}, buffer
        )
        await self.rt.store.put_bytes(self.state_key, buffer.getvalue())
        self.version = version
        self.rt.log.info("published weights", run_id=self.run_id, version=version, step=self.step)

    async def _event(self, kind: str, data: dict, msg_id: str | None = None) -> None:
        event = Event(run_id=self.run_id, kind=kind, ts=time.time(), data=data, source=self.settings.replica)
        await self.rt.bus.publish(subjects.events(self.run_id, kind.replace(".", "_")), event, msg_id=msg_id)

    async def on_graded(self, graded: GradedTrajectory, delivery: Delivery) -> None:
        trajectory = graded.trajectory
        if trajectory.run_id != self.run_id:
            raise ValueError(f"graded trajectory of run {trajectory.run_id} on run {self.run_id}'s subject")
        delivery.hold()
        group = self.groups.setdefault(trajectory.group_id, Group())
        group.members[trajectory.trajectory_id] = (graded, delivery)  # a redelivery replaces the old handle
        self.arrived.set()

    def _ready_groups(self) -> list[str]:
        size, now = self.config.group_size, time.monotonic()
        timeout = self.settings.trainer_group_timeout_s
        return [
            gid
            for gid, g in sorted(self.groups.items(), key=lambda item: item[1].first_seen)
            if len(g.members) >= size or (len(g.members) >= 2 and now - g.first_seen > timeout)
        ][: self.config.groups_per_step]

    async def _heartbeat(self, run_delivery: Delivery) -> None:
        while not self.stop_consuming.is_set():
            await asyncio.sleep(self.settings.trainer_heartbeat_s)
            await run_delivery.in_progress()
            for group in list(self.groups.values()):
                for _, delivery in list(group.members.values()):
                    await delivery.in_progress()

    async def run(self, run_delivery: Delivery) -> None:
        await self._resume()
        if self.version < 0:
            await self._publish_version()
        await self._event("run.status", {"status": "running"}, msg_id=f"{self.run_id}/status/running")
        consumer = self.rt.spawn(
            self.rt.bus.consume(
                stream=subjects.GRADED,
                durable=f"trainer-{self.run_id}",
                filter_subject=subjects.graded(self.run_id),
                handler=self.on_graded,
                message_type=GradedTrajectory,
                stop=self.stop_consuming,
                ack_wait=120,
                batch=8,
                max_ack_pending=1024,
            ),
            name=f"graded-{self.run_id}",
        )
        heartbeat = asyncio.create_task(self._heartbeat(run_delivery))
        try:
            while self.step < self.config.max_steps and not self.rt.stopping.is_set():
                ready = self._ready_groups()
                if len(ready) < self.config.groups_per_step:
                    self.arrived.clear()
                    try:
                        await asyncio.wait_for(self.arrived.wait(), timeout=1.0)
                    except TimeoutError:
                        pass
                    continue
                await self._train([self.groups.pop(gid) for gid in ready])
            if self.rt.stopping.is_set():
                # Hand the run and everything held back at once: a trainer (this one, restarted) resumes.
                await self._hand_back(run_delivery)
                return
            if self.step % self.config.publish_every:
                await self._publish_version()
            await self.rt.redis.set(finished_key(self.run_id), "1", ex=7 * 86400)
            await self._event("run.status", {"status": "finished"}, msg_id=f"{self.run_id}/status/finished")
            await run_delivery.ack()
        finally:
            self.stop_consuming.set()
            heartbeat.cancel()
            await asyncio.gather(consumer, heartbeat, return_exceptions=True)

    async def _hand_back(self, run_delivery: Delivery) -> None:
        for group in self.groups.values():
            for _, delivery in group.members.values():
                await delivery.msg.nak()
        self.groups.clear()
        await run_delivery.msg.nak()

    async def _train(self, groups: list[Group]) -> None:
        started = time.perf_counter()
        graded, advantages, deliveries, stale, lags = [], [], [], [], []
        for group in groups:
            kept = []
            for g, delivery in group.members.values():
                sampled = [v for v, m in zip(unpack("u32", g.trajectory.versions), unpack("u8", g.trajectory.loss_mask)) if m]
                lag = staleness(trainer_version=self.version, token_versions=sampled)
                if lag > self.config.max_staleness:
                    stale.append(g.trajectory.trajectory_id)
                    deliveries.append(delivery)
                    continue
                kept.append((g, delivery))
                lags.append(lag)
            if len(kept) < 2:
                deliveries.extend(d for _, d in kept)
                continue
            rewards = torch.tensor([g.reward.total for g, _ in kept])
            advantages.extend(group_relative_advantages(rewards).tolist())
            graded.extend(g for g, _ in kept)
            deliveries.extend(d for _, d in kept)
        metrics: dict[str, float] = {}
        if graded:
            batch = collate(graded, advantages)
            metrics = await asyncio.to_thread(
                train_step,
                model=self.model,
                optimizer=self.optimizer,
                batch=batch,
                clip_eps=self.config.clip_eps,
                temperature=self.config.temperature,
            )
        for delivery in deliveries:
            await delivery.ack()
        self.step += 1
        rewards_all = [g.reward.total for g in graded]
        duration = time.perf_counter() - started
        metrics.update(
            {
                "reward_mean": sum(rewards_all) / len(rewards_all) if rewards_all else 0.0,
                "reward_max": max(rewards_all, default=0.0),
                "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
                "staleness_max": float(max(lags, default=0)),
                "trajectories": float(len(graded)),
                "stale_dropped": float(len(stale)),
                "step_seconds": duration,
            }
        )
        await self._event(
            "step",
            {
                "step": self.step,
                "version": self.version,
                **metrics,
                "trajectory_ids": [g.trajectory.trajectory_id for g in graded],
                "stale_trajectory_ids": stale,
            },
            msg_id=f"{self.run_id}/step/{self.step}",
        )
        self.rt.log.info("step", run_id=self.run_id, step=self.step, **{k: round(v, 4) for k, v in metrics.items()})
        if self.step % self.config.publish_every == 0:
            await self._publish_version()
