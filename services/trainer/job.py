"""One training run: consume graded groups, take optimizer steps in the run's worker group, publish
weight versions.

The policy lives in the run's worker group (services.trainer.group: `parallel` in the run config, one
rank or many, local processes or Ray actors); this job feeds it batches and keeps the run's books.
Order of each step: train; every `schedule.save_every` steps and at every published version, save the
trainer state (each rank's shards of the weights and optimizer with torch.distributed.checkpoint, then
the step, version and the ids trained so far) to the object store; publish the weight version if one
is due; then ack the messages trained since the last save. A trainer (or a rank) that dies at any point
resumes from the saved state in a fresh group: messages it had not acked are redelivered and trained
again, those the saved state already trained on are acked and skipped, and a version the state holds
but the checkpoints never announced is published again (the same bytes, so the commit is idempotent).
Acked means trained and saved: each trajectory is in the saved state at most once.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from crucible.agent.solutions import DemonstrationError
from crucible.agent.toolcalls import ToolCallGrammar
from crucible.bus import Delivery
from crucible.clients.checkpoints import WeightsPublisher, load_weights
from crucible.contracts import ContractError, subjects
from crucible.contracts.events import EvalReport, Event, EventPayload, RunStatus, StepReport, WarmStartReport
from crucible.contracts.keys import DAY_S, finished_key, refills_key, trainer_state_key
from crucible.contracts.messages import (
    EvalRequest,
    GradedTrajectory,
    ObjectRef,
    RunCreated,
    scheduled_eval_id,
)
from crucible.contracts.packing import unpack
from crucible.contracts.trajectories import check_trajectory
from crucible.model.sources import load_tokenizer, model_config
from crucible.objectstore import IntegrityError, ObjectNotFound
from crucible.outage import Unavailable
from crucible.rl.advantages import group_advantages, is_uniform
from crucible.rl.staleness import staleness
from crucible.runs import end_run, run_end
from crucible.runtime import Runtime
from services.trainer.group import NonFiniteStep, PolicyGroup
from services.trainer.metrics import SKIPPED_STEPS, STEP_SECONDS, STEPS, TRAJECTORIES, VERSION
from services.trainer.settings import Settings
from services.trainer.sft import batches, render

PUBLISH_ATTEMPTS = 5
MAX_REPORTED_LOSSES = 200


class RunStartError(RuntimeError):
    """The run cannot start: its initial weights or its warm start's demonstrations are missing."""


class RunFailed(RuntimeError):
    """The run cannot go on (the message says why): it ends as failed."""


class SavedState(msgspec.Struct, kw_only=True):
    """The index of one saved trainer state: the run's books, and the ranks' checkpoint files (written by
    torch.distributed.checkpoint) with the sha256 each must read back with. Written last: a state whose
    index is missing or whose files do not verify was torn, and the other slot holds the one before."""

    step: int
    version: int
    trained: list[str]
    last_step: StepReport | None = None
    world_size: int
    files: dict[str, ObjectRef]


@dataclass
class Group:
    members: dict[str, tuple[GradedTrajectory, Delivery]] = field(default_factory=dict)
    first_seen: float = field(default_factory=time.monotonic)


class RunJob:
    def __init__(self, *, rt: Runtime[Settings], created: RunCreated) -> None:
        self.rt = rt
        self.settings = rt.settings
        self.run_id = created.run_id
        self.config = created.config
        self.policy: PolicyGroup | None = None  # the run's worker group, started by `run`
        self.publisher = WeightsPublisher(
            bus=rt.bus, store=rt.store, run_id=self.run_id, full_every=self.settings.full_every
        )
        architecture = model_config(self.config.model.source)  # read once: a package's from its file
        self.max_seq_len = architecture.max_seq_len
        self.dropped_groups = 0  # uniform-reward groups dropped since the last step
        self.skipped_steps = 0  # steps skipped for non-finite numbers since the last step taken
        self.tokenizer = load_tokenizer(self.config.model.source)
        self.tool_calls = (  # the rollouts' action grammar, replayed over the sampled tokens
            None
            if self.tokenizer is None
            else ToolCallGrammar.for_agent(
                self.tokenizer, vocab_size=architecture.vocab_size, agent=self.config.agent
            )
        )
        self.step = 0
        self.version = -1
        self.state_slot = 1  # the slot of the last state saved (the first save goes to slot 0)
        self.trained: set[str] = set()
        self.last_step: StepReport | None = None
        self.groups: dict[str, Group] = {}
        self.in_step: list[Delivery] = []  # the step being taken's messages
        self.unsaved: list[Delivery] = []  # trained since the last saved state: acked once it is saved
        self.steps_unsaved = 0
        if self.settings.state_dir is not None:
            self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = Path(tempfile.mkdtemp(prefix=f"{self.run_id}-", dir=self.settings.state_dir))
        self.arrived = asyncio.Event()
        self.last_arrival = time.monotonic()  # of a graded trajectory (or the run's start on this trainer)
        self.last_refill = 0.0  # when groups lost in flight were last replaced
        self.stop_consuming = asyncio.Event()
        self.consumer: asyncio.Task | None = None

    async def _start_group(self) -> None:
        self.policy = await asyncio.to_thread(
            PolicyGroup, self.config, timeout_s=self.settings.step_timeout_s, threads=self.settings.torch_threads,
            ray_address=self.settings.ray_address,
        )  # fmt: skip
        self.rt.log.info("worker group started", run_id=self.run_id, world_size=self.policy.world_size,
                         launcher=self.policy.launcher)  # fmt: skip

    async def _call(self, method: str, *args, **kwargs):
        """A call on the run's worker group, in a thread (it blocks until every rank has answered)."""
        return await asyncio.to_thread(getattr(self.policy, method), *args, **kwargs)

    async def _resume(self) -> None:
        """Take back the newest of the two saved states that reads whole (one torn or corrupt write
        costs at most the steps since the save before it); none saved: a new run."""
        found, unreadable = [], []
        for slot in (0, 1):
            try:
                data = await self.rt.store.get_bytes(self.rt.store.uri(trainer_state_key(self.run_id, slot)), verify=False)
                found.append((slot, msgspec.json.decode(data, type=SavedState)))
            except ObjectNotFound:
                continue
            except Unavailable:  # S3 away: the newest state may be in this slot; resume once it answers
                raise
            except Exception as exc:  # a torn or foreign object: the other slot holds the state before it
                unreadable.append(slot)
                self.rt.log.warning("trainer state unreadable", run_id=self.run_id, slot=slot, error=repr(exc))
        for slot, state in sorted(found, key=lambda item: (item[1].step, item[1].version), reverse=True):
            if state.world_size != self.config.parallel.world_size:
                raise RunFailed(f"the saved state is of {state.world_size} ranks, the run's config has {self.config.parallel.world_size}")
            directory = self.state_dir / f"resume-{slot}"
            try:
                await self._download(state.files, directory)
            except Unavailable:
                raise
            except (IntegrityError, ObjectNotFound) as exc:  # torn: files of a later save, or missing
                unreadable.append(slot)
                self.rt.log.warning("trainer state unreadable", run_id=self.run_id, slot=slot, error=repr(exc))
                continue
            await self._call("load", str(directory))
            shutil.rmtree(directory, ignore_errors=True)
            self.state_slot, self.step, self.version = slot, state.step, state.version
            self.trained = set(state.trained)
            self.last_step = state.last_step
            self.rt.log.info("resumed run", run_id=self.run_id, step=self.step, version=self.version, slot=slot)
            return
        if unreadable:
            raise RunFailed(f"no saved trainer state reads whole (slots {sorted(set(unreadable))}): the run cannot resume")

    async def _download(self, files: dict[str, ObjectRef], directory: Path) -> None:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        for name, ref in files.items():
            (directory / name).write_bytes(await self.rt.store.get_bytes(ref))

    async def _start(self) -> None:
        """A new run's version 0: the source's weights (or `model.init`'s), then the warm start if any."""
        init = self.config.model.init
        if init:
            run_id, _, version = init.partition("@")
            try:
                _, state = await load_weights(bus=self.rt.bus, store=self.rt.store, run_id=run_id, version=int(version))
                await self._call("load_weights", state)
            except Unavailable:
                raise  # an outage, not a bad init: the run starts once the checkpoints service answers
            except Exception as exc:
                raise RunStartError(f"model.init {init}: cannot start from it: {exc}") from exc
            self.rt.log.info("starting from another run's weights", run_id=self.run_id, init=init)
        if self.config.sft.steps:
            await self._warm_start()

    async def _warm_start(self) -> None:
        started = time.perf_counter()
        sft = self.config.sft
        try:
            demos = await render(
                self.rt, run_id=self.run_id, config=self.config, tokenizer=self.tokenizer, tool_calls=self.tool_calls,
                max_context=min(self.settings.max_context, self.max_seq_len),
            )  # fmt: skip
        except DemonstrationError as exc:
            raise RunStartError(str(exc)) from exc
        if not demos.trajectories:
            raise RunStartError(f"sft: no demonstration could be played (left out: {dict(demos.skipped) or 'none found'})")
        self.rt.log.info(
            "warm start", run_id=self.run_id, demonstrations=len(demos.trajectories), skipped=dict(demos.skipped)
        )
        losses, tokens = [], 0
        for batch in batches(demos.trajectories, steps=sft.steps, batch_size=sft.batch_size, seed=self.config.seed):
            if self.rt.stopping.is_set():
                return  # nothing saved yet: a trainer that takes the run back starts the warm start again
            try:
                metrics = await self._call("sft", batch, learning_rate=sft.learning_rate)
            except NonFiniteStep as exc:
                raise RunStartError(f"sft: {exc}") from exc
            losses.append(metrics["loss"])
            tokens += int(metrics["tokens"])
        await self._call("end_sft")
        every = -(-len(losses) // MAX_REPORTED_LOSSES)
        report = WarmStartReport(
            demonstrations=len(demos.trajectories), skipped=dict(demos.skipped), steps=len(losses), tokens=tokens,
            losses=losses[::every], loss_every=every, seconds=time.perf_counter() - started,
        )  # fmt: skip
        await self._event(report)
        self.rt.log.info(
            "warm start trained", run_id=self.run_id, steps=len(losses), loss_first=losses[0], loss_last=losses[-1]
        )

    async def _load_reference(self) -> None:
        """The KL term's reference: version 0 as published (the start RL departs from)."""
        if self.config.optim.kl_coef > 0:
            _, state = await load_weights(bus=self.rt.bus, store=self.rt.store, run_id=self.run_id, version=0)
            await self._call("set_reference", state)

    async def _save_state(self) -> None:
        """Every rank writes its shards, the files go to the object store, the index last; then the
        messages trained since the previous save are acknowledged."""
        slot = 1 - self.state_slot  # the other slot keeps the state before this one
        directory = self.state_dir / f"slot-{slot}"
        shutil.rmtree(directory, ignore_errors=True)
        await self._call("save", str(directory))
        files = {}
        for path in sorted(directory.iterdir()):
            data = await asyncio.to_thread(path.read_bytes)
            files[path.name] = await self.rt.store.put_bytes(trainer_state_key(self.run_id, slot, path.name), data)
        shutil.rmtree(directory, ignore_errors=True)
        state = SavedState(
            step=self.step, version=self.version, trained=sorted(self.trained), last_step=self.last_step,
            world_size=self.config.parallel.world_size, files=files,
        )  # fmt: skip
        await self.rt.store.put_bytes(trainer_state_key(self.run_id, slot), msgspec.json.encode(state))
        self.state_slot = slot
        self.steps_unsaved = 0
        for delivery in self.unsaved:
            await delivery.ack()
        self.unsaved = []

    async def _publish(self) -> None:
        """Publish the current weights as `self.version` (a full snapshot every `full_every` versions and
        after a restart, else an exact delta), retrying while the checkpoints service is away."""
        weights = await self._call("weights")
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                manifest = await self.publisher.publish(version=self.version, step=self.step, state_dict=weights)
                break
            except Exception as exc:
                if attempt == PUBLISH_ATTEMPTS:
                    raise
                self.rt.log.warning("publishing weights failed; retrying", run_id=self.run_id, error=repr(exc))
                await asyncio.sleep(2**attempt)
        VERSION.labels(self.run_id).set(self.version)
        self.rt.log.info("published weights", run_id=self.run_id, version=self.version, step=self.step,
                         kind=manifest.kind, bytes=sum(s.size for s in manifest.shards))  # fmt: skip
        every = self.config.eval.every_versions
        if every and self.version and self.version % every == 0:
            await self._request_eval()

    async def _request_eval(self) -> None:
        """Ask for the evaluation the run's `eval` section schedules at the current version (once: its id
        is the message id, so asking again after a crash is dropped as a duplicate)."""
        eval_id = scheduled_eval_id(self.run_id, self.version)
        request = EvalRequest.for_run(
            eval_id=eval_id, run_id=self.run_id, version=self.version, config=self.config, source="schedule"
        )
        await self.rt.bus.publish(subjects.eval_requested(self.run_id), request, msg_id=eval_id)
        await self._event(EvalReport(request=request, status="requested"))
        self.rt.log.info("evaluation requested", run_id=self.run_id, version=self.version, eval_id=eval_id)

    async def _event(self, data: EventPayload) -> None:
        event = Event.now(self.run_id, data, source=self.settings.replica)
        await self.rt.bus.publish(event.subject, event, msg_id=event.msg_id)

    async def on_graded(self, graded: GradedTrajectory, delivery: Delivery) -> None:
        trajectory = graded.trajectory
        if trajectory.run_id != self.run_id:
            raise ContractError(f"graded trajectory of run {trajectory.run_id} on run {self.run_id}'s subject")
        check_trajectory(trajectory)  # a non-finite reward is the step's to skip, with its reason
        if trajectory.eval_id:
            return  # an evaluation's episode: graded for the record, never trained on
        if trajectory.trajectory_id in self.trained:
            return  # trained before a restart; acked now
        delivery.hold()
        delivery.keep_alive(every_s=self.settings.heartbeat_s)
        group = self.groups.setdefault(trajectory.group_id, Group())
        replaced = group.members.get(trajectory.trajectory_id)
        if replaced is not None:  # a redelivery replaces the old handle
            replaced[1].stop_keep_alive()
        group.members[trajectory.trajectory_id] = (graded, delivery)
        self.last_arrival = time.monotonic()
        self.arrived.set()

    def _ready_groups(self) -> list[str]:
        size, now = self.config.schedule.group_size, time.monotonic()
        timeout = self.settings.group_timeout_s
        return [
            gid
            for gid, g in sorted(self.groups.items(), key=lambda item: item[1].first_seen)
            if len(g.members) >= size or (len(g.members) >= 2 and now - g.first_seen > timeout)
        ][: self.config.schedule.groups_per_step]

    async def run(self, run_delivery: Delivery) -> None:
        """Train the run to its end; `run_delivery` (its RunCreated message) is held until then."""
        try:
            if await self._ended_elsewhere():  # before a trainer took it up
                await self._stop_ended(run_delivery)
                return
            await self._start_group()
            try:
                await self._resume()
            except RunFailed as exc:
                await self._fail(run_delivery, str(exc))
                return
            await self._event(RunStatus(status="running"))
            if self.version < 0:
                try:
                    await self._start()
                except RunStartError as exc:
                    await self._fail(run_delivery, str(exc))
                    return
                if self.rt.stopping.is_set():
                    await self._hand_back(run_delivery)
                    return
                self.version = 0
                await self._save_state()
            await self._publish()  # v0, or a version saved but perhaps never announced before a crash
            await self._load_reference()
            if self.last_step:  # saved with the state; its event may have been lost in a crash
                await self._event(self.last_step)
            self.consumer = self.rt.spawn(self._consume(), name=f"graded-{self.run_id}")
            self.last_arrival = time.monotonic()
            while self.step < self.config.schedule.max_steps and not self.rt.stopping.is_set():
                if await self._ended_elsewhere():
                    await self._stop_ended(run_delivery)
                    return
                if self.config.optim.drop_uniform_groups:
                    await self._drop_uniform_groups()
                ready = self._ready_groups()
                if len(ready) < self.config.schedule.groups_per_step:
                    waited = time.monotonic() - self.last_arrival
                    if waited > self.settings.stall_timeout_s:
                        await self._fail(run_delivery, f"no graded trajectory came for {waited:.0f} s: the run cannot progress")
                        return
                    await self._replace_lost_groups(len(ready), waited)
                    self.arrived.clear()
                    try:
                        await asyncio.wait_for(self.arrived.wait(), timeout=1.0)
                    except TimeoutError:
                        pass
                    continue
                try:
                    await self._train([self.groups.pop(gid) for gid in ready])
                except RunFailed as exc:
                    await self._fail(run_delivery, str(exc))
                    return
            if self.rt.stopping.is_set():
                # Hand the run and everything held back at once: a trainer (this one, restarted) resumes.
                await self._hand_back(run_delivery)
                return
            await self._finish(run_delivery)
        except BaseException:
            await self._let_go()
            raise
        finally:
            await self._stop_consuming()
            if self.policy is not None:
                await asyncio.to_thread(self.policy.close)
            shutil.rmtree(self.state_dir, ignore_errors=True)

    async def _stop_consuming(self) -> None:
        """Stop taking graded messages, and wait until the consumer has stopped: before messages are
        handed back, or the consumer would take them straight back into this job."""
        self.stop_consuming.set()
        if self.consumer is not None:
            await asyncio.gather(self.consumer, return_exceptions=True)

    async def _let_go(self) -> None:
        """This job failed: hand back the graded trajectories it holds, so the next job (this trainer's,
        after a backoff, or another's) gets them again instead of their keep-alives holding them."""
        await self._stop_consuming()
        held = [d for group in self.groups.values() for _, d in group.members.values()] + self.in_step + self.unsaved
        self.groups.clear()
        self.in_step, self.unsaved = [], []
        for delivery in held:
            try:
                await delivery.nak()
            except Exception as exc:  # the bus is away: with its keep-alive stopped, it returns after ack_wait
                self.rt.log.debug("could not hand back a held trajectory", error=repr(exc))

    async def _drop_uniform_groups(self) -> None:
        """DAPO's dynamic sampling: a complete group whose rewards are all equal carries no signal; it is
        acknowledged untrained, and the rollouts are told to admit one more group in its place."""
        size = self.config.schedule.group_size
        for gid, group in list(self.groups.items()):
            if len(group.members) < size:
                continue
            if not is_uniform(torch.tensor([g.reward.total for g, _ in group.members.values()])):
                continue
            del self.groups[gid]
            for _, delivery in group.members.values():
                await delivery.ack()
            self.dropped_groups += 1
            TRAJECTORIES.labels(self.run_id, "uniform").inc(len(group.members))
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
        try:
            async with self.rt.redis.pipeline(transaction=True) as pipe:
                await pipe.incrby(refills_key(self.run_id), groups).expire(refills_key(self.run_id), DAY_S).execute()
        except Exception as exc:  # Redis is coordination only: the run may then admit fewer groups
            self.rt.log.warning("could not ask for a refill", run_id=self.run_id, error=repr(exc))

    async def _consume(self) -> None:
        await self.rt.bus.consume(
            stream=subjects.GRADED,
            durable=subjects.trainer_run_durable(self.run_id),
            filter_subject=subjects.graded(self.run_id),
            handler=self.on_graded,
            message_type=GradedTrajectory,
            stop=self.stop_consuming,
            ack_wait=self.settings.ack_wait_s,
            batch=8,
            max_ack_pending=4096,
            max_deliver=100,  # held messages come back once per trainer restart
        )

    async def _finish(self, run_delivery: Delivery) -> None:
        publish = self.step % self.config.schedule.publish_every != 0
        if publish:
            self.version += 1
        if publish or self.steps_unsaved:
            await self._save_state()
        if publish:
            await self._publish()
        if self.config.eval.at_end:
            await self._request_eval()
        await self._announce_end("finished")
        await self._release_groups()  # spare groups nobody needs any more
        await run_delivery.ack()
        await self._delete_consumer()

    async def _ended_elsewhere(self) -> bool:
        """Whether another service ended the run: an operator cancelled it (through the api), or the
        rollouts failed it because they cannot run it."""
        return await run_end(self.rt.bus, self.run_id) is not None

    async def _stop_ended(self, run_delivery: Delivery) -> None:
        """Stop at once: what was trained and published stays; what waits to be trained is acknowledged."""
        end = await run_end(self.rt.bus, self.run_id)
        self.rt.log.info("run ended elsewhere", run_id=self.run_id, status=end and end.status,
                         error=end and end.error, step=self.step, version=self.version)  # fmt: skip
        self.stop_consuming.set()
        await self._release_groups()
        await run_delivery.ack()
        await self._delete_consumer()

    async def _release_groups(self) -> None:
        """Acknowledge the groups nobody will train on (graded, recorded by the api, never trained)."""
        for group in self.groups.values():
            for _, delivery in group.members.values():
                await delivery.ack()
        self.groups.clear()

    async def _delete_consumer(self) -> None:
        durable = subjects.trainer_run_durable(self.run_id)
        try:
            await self.rt.bus.js.delete_consumer(subjects.GRADED, durable)
        except Exception as exc:  # already gone, or the server is busy: it only costs a little memory
            self.rt.log.warning("could not delete the run's consumer", durable=durable, error=repr(exc))

    async def _fail(self, run_delivery: Delivery, error: str) -> None:
        """End a run that cannot start or go on: said over the run's events (REST shows it), never retried."""
        self.rt.log.error("run failed", run_id=self.run_id, error=error)
        await self._announce_end("failed", error)
        await self._release_groups()
        await run_delivery.ack()
        await self._delete_consumer()

    async def _announce_end(self, status: str, error: str = "") -> None:
        """The durable end of the run (rollouts stop admitting work), its Redis cache and its status event."""
        await end_run(
            self.rt.bus, run_id=self.run_id, status=status, step=self.step, version=self.version, error=error,
            source=self.settings.replica,
        )  # fmt: skip
        await self.rt.redis.set(finished_key(self.run_id), "1", ex=7 * 86400)
        self.stop_consuming.set()

    async def _hand_back(self, run_delivery: Delivery) -> None:
        """Stopping: everything held goes back at once, the run included; what was trained since the last
        save is trained again by whichever trainer resumes the run."""
        await self._stop_consuming()
        for delivery in [d for group in self.groups.values() for _, d in group.members.values()] + self.unsaved:
            await delivery.nak()
        self.groups.clear()
        self.unsaved = []
        await run_delivery.nak()

    async def _train(self, groups: list[Group]) -> None:
        started = time.perf_counter()
        graded, advantages, stale, too_small, lags, ages = [], [], [], [], [], []
        publish_every = self.config.schedule.publish_every
        self.in_step = [d for group in groups for _, d in group.members.values()]
        for group in groups:
            kept = []
            for g, _ in group.members.values():
                sampled = [v for v, m in zip(unpack("u32", g.trajectory.versions), unpack("u8", g.trajectory.loss_mask)) if m]
                lag = staleness(trainer_version=self.version, token_versions=sampled)
                if lag > self.config.schedule.max_staleness:
                    stale.append(g.trajectory.trajectory_id)
                    continue
                kept.append(g)
                lags.append(lag)
                # optimizer steps since the oldest sampled token's version was published
                ages.append(self.step - min(sampled, default=self.version) * publish_every)
            if len(kept) < 2:  # no baseline to compare against: a group-relative advantage needs two
                too_small.extend(g.trajectory.trajectory_id for g in kept)
                continue
            rewards = torch.tensor([g.reward.total for g in kept])
            optim = self.config.optim
            advantages.extend(
                group_advantages(
                    rewards, estimator=optim.advantage, std=optim.advantage_std, eps=optim.advantage_eps
                ).tolist()
            )
            graded.extend(kept)
        TRAJECTORIES.labels(self.run_id, "stale").inc(len(stale))
        TRAJECTORIES.labels(self.run_id, "alone").inc(len(too_small))
        if not graded:
            self.rt.log.warning("no trainable trajectories in these groups", run_id=self.run_id, stale=len(stale))
            await self._ack_step()
            return
        try:
            if not all(math.isfinite(g.reward.total) for g in graded):
                raise NonFiniteStep("rewards")
            if not all(math.isfinite(a) for a in advantages):
                raise NonFiniteStep("advantages")
            metrics = await self._call("train", [g.trajectory for g in graded], advantages)
        except NonFiniteStep as exc:
            await self._skip_step(exc, [g.trajectory.trajectory_id for g in graded], groups=len(groups))
            return
        self.step += 1
        self.trained.update(g.trajectory.trajectory_id for g in graded)
        STEPS.labels(self.run_id).inc()
        TRAJECTORIES.labels(self.run_id, "trained").inc(len(graded))
        publish = self.step % self.config.schedule.publish_every == 0
        rewards_all = [g.reward.total for g in graded]
        metrics.update(
            {
                "reward_mean": sum(rewards_all) / len(rewards_all),
                "resolved_rate": sum(g.reward.resolved for g in graded) / len(graded),
                "reward_max": max(rewards_all),
                "staleness_mean": sum(lags) / len(lags),
                "staleness_max": float(max(lags)),
                "token_age_steps_max": float(max(ages)),
                "trajectories": float(len(graded)),
                "stale_dropped": float(len(stale)),
                "groups_dropped": float(self.dropped_groups),
                "groups_dropped_fraction": self.dropped_groups / (self.dropped_groups + len(groups)),
                "skipped_steps": float(self.skipped_steps),
                **{f"staleness_lag_{lag}": float(lags.count(lag)) for lag in range(max(lags) + 1)},
                "step_seconds": time.perf_counter() - started,
                "world_size": float(self.config.parallel.world_size),  # ranks that took the step
            }
        )
        self.dropped_groups = self.skipped_steps = 0
        STEP_SECONDS.observe(metrics["step_seconds"])
        self.last_step = StepReport(
            step=self.step,
            version=self.version,  # the version the batch trained against
            trajectory_ids=[g.trajectory.trajectory_id for g in graded],
            dropped_stale_ids=stale,
            dropped_alone_ids=too_small,
            metrics=metrics,
        )
        if publish:
            self.version += 1
        self.unsaved += self.in_step
        self.in_step = []
        self.steps_unsaved += 1
        if publish or self.steps_unsaved >= self.config.schedule.save_every:
            await self._save_state()
        if publish:
            await self._publish()
        await self._event(self.last_step)
        self.rt.log.info("step", run_id=self.run_id, step=self.step, **{k: round(v, 4) for k, v in metrics.items()})

    async def _skip_step(self, exc: NonFiniteStep, trajectory_ids: list[str], *, groups: int) -> None:
        """A step whose numbers are not finite is not taken: nothing is trained, saved or published, its
        trajectories are acknowledged untrained (they would fail again) and as many groups are asked
        for again, and after
        `max_nonfinite_steps` such steps in a row the run fails with the reason."""
        self.skipped_steps += 1
        SKIPPED_STEPS.labels(self.run_id, exc.reason).inc()
        TRAJECTORIES.labels(self.run_id, "non_finite").inc(len(trajectory_ids))
        self.rt.log.error(
            "step skipped", run_id=self.run_id, reason=exc.reason, in_a_row=self.skipped_steps,
            trajectories=trajectory_ids[:8],
        )  # fmt: skip
        await self._ack_step()
        await self._refill(groups)
        limit = self.settings.max_nonfinite_steps
        if self.skipped_steps >= limit:
            raise RunFailed(f"{self.skipped_steps} steps in a row had non-finite {exc.reason} (limit {limit})")

    async def _ack_step(self) -> None:
        for delivery in self.in_step:
            await delivery.ack()
        self.in_step = []
