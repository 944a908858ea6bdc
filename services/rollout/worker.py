"""Everything one rollout replica does for one run: follow its weight versions, admit groups within the
staleness bound, sample a task per group, run the group's episodes in forked sandboxes, publish the
trajectories and report progress."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import TypedDict

from redis.exceptions import RedisError

from crucible.agent.episode import run_episode
from crucible.clients.checkpoints import WeightsFollower
from crucible.clients.sandbox import SandboxClient, SandboxSession
from crucible.contracts import endpoints
from crucible.contracts.events import Event, RolloutReport
from crucible.contracts.messages import SampleRequest, TaskSpec, Trajectory, WeightsAnnounced
from crucible.contracts.runconfig import RunConfig
from crucible.contracts.trajectories import arrays
from crucible.outage import Unavailable
from crucible.runs import end_run, run_end
from crucible.runtime import Runtime
from services.rollout.admission import budget_spent, release, try_admit
from services.rollout.engine import PolicyEngine
from services.rollout.external import ExternalEngine
from services.rollout.harness import Episodes, run_harness_episode
from services.rollout.metrics import (
    BUSY_SECONDS,
    EPISODES,
    GROUP_SECONDS,
    GROUPS_IN_FLIGHT,
    LOAD_SECONDS,
    TOKENS,
    VERSION,
)
from services.rollout.publish import publish_trajectory
from services.rollout.settings import Settings
from services.rollout.slots import EpisodeSlots, Held

GROUP_RETRY_S = 2.0
REDIS_ERRORS = (RedisError, OSError)
SANDBOX_TTL_S = 600.0  # idle time after which a crashed rollout's sandboxes are reaped
ERROR_CHARS = 2000


class _EpisodeArgs(TypedDict):
    """What an episode is run with, besides its engine (the builtin loop's and a harness's alike)."""

    config: RunConfig
    task: TaskSpec
    session: SandboxSession
    run_id: str
    group_id: str
    seed: int
    replica: str
    tool_timeout_s: float


class RunWorker:
    """Everything one replica does for one run."""

    def __init__(
        self,
        *,
        rt: Runtime[Settings],
        run_id: str,
        config: RunConfig,
        episodes: Episodes,
        slots: EpisodeSlots,
    ) -> None:
        self.rt = rt
        self.slots = slots
        self.episodes_endpoint = episodes
        self.settings = rt.settings
        self.run_id = run_id
        self.config = config
        self.engine: PolicyEngine | ExternalEngine
        if self.settings.engine_url:
            weights_dir = self.settings.engine_weights_dir
            assert weights_dir is not None  # required with engine_url (Settings' validator)
            self.engine = ExternalEngine(
                config=config,
                url=self.settings.engine_url,
                kind=self.settings.engine_kind,
                weights_dir=weights_dir / run_id,
                max_context=self.settings.max_context,
                timeout_s=self.settings.engine_timeout_s,
            )
        else:
            self.engine = PolicyEngine(
                config=config,
                max_context=self.settings.max_context,
                max_sequences=self.settings.max_episodes,
                prefill_chunk=self.settings.prefill_chunk,
            )
        # keeps the last full version
        self.weights = WeightsFollower(bus=rt.bus, store=rt.store, run_id=run_id)
        self.new_version = asyncio.Event()
        self.latest_announced = -1
        self.sandboxes = SandboxClient(rt.bus)
        self.episodes = 0
        self.tokens = 0
        self.failed_groups = 0  # in a row, for the run's own reasons (never an outage)
        self.started = time.monotonic()
        self.in_flight = 0
        self.busy_since = 0.0

    async def on_announced(self, announced: WeightsAnnounced) -> None:
        self.latest_announced = max(self.latest_announced, announced.version)
        self.rt.spawn(self._load(announced.version), name=f"load-{self.run_id}-{announced.version}")

    async def _load(self, version: int) -> None:
        if version < self.latest_announced or version <= self.engine.version:
            return  # a newer version is on its way or already loaded
        started = time.monotonic()
        try:
            manifest, state = await self.weights.load(version)  # shards in parallel, every tensor verified
            if manifest.version < self.latest_announced:
                return  # a newer one was announced while this downloaded
            await self.engine.load(state, manifest.version)
        except Exception as exc:  # keep sampling with the weights we have; the next announcement retries
            self.rt.log.error("could not load weights", run_id=self.run_id, version=version, error=repr(exc))
            return
        LOAD_SECONDS.labels(self.run_id).observe(time.monotonic() - started)
        VERSION.labels(self.run_id).set(self.engine.version)
        self.rt.log.info("weights swapped in", run_id=self.run_id, version=self.engine.version)
        self.new_version.set()

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            await self.engine.aclose()
        await self._report()
        self.rt.log.info("run finished on this replica", run_id=self.run_id, episodes=self.episodes)

    async def _run(self) -> None:
        per_group = self.config.schedule.group_size + 1  # the task's sandbox and its forks
        groups: set[asyncio.Task] = set()
        while not self.rt.stopping.is_set():
            try:
                if await self._finished():
                    break
                if await budget_spent(redis=self.rt.redis, run_id=self.run_id, config=self.config):
                    if not groups:
                        break
                    # a group in flight that produces nothing gives its index back: admit it again
                    await asyncio.wait(set(groups), return_when=asyncio.FIRST_COMPLETED)
                    continue
            except (*REDIS_ERRORS, Unavailable) as exc:
                await self._away(exc)
                continue
            if self.engine.version < 0:
                await self._wait_for_version()
                continue
            held = await self.slots.take(per_group)
            try:
                index = await try_admit(
                    redis=self.rt.redis, run_id=self.run_id, config=self.config, version=self.engine.version
                )
            except REDIS_ERRORS as exc:
                held.close()
                await self._away(exc)
                continue
            if index is None:
                held.close()
                await self._wait_for_version()
                continue
            task = asyncio.create_task(self._group(index, held))
            groups.add(task)
            task.add_done_callback(lambda t, held=held: (groups.discard(t), held.close()))
        if groups:
            await asyncio.gather(*groups, return_exceptions=True)

    async def _away(self, exc: BaseException) -> None:
        """Admission is counted in Redis and the run's end is read from NATS: while either is away (or
        restarting), no group is admitted."""
        self.rt.log.warning("cannot admit a group for now", run_id=self.run_id, error=repr(exc))
        await asyncio.sleep(GROUP_RETRY_S)

    async def _finished(self) -> bool:
        """The trainer's durable end-of-run marker (Redis only caches it)."""
        return await run_end(self.rt.bus, self.run_id) is not None

    async def _wait_for_version(self) -> None:
        self.new_version.clear()
        try:
            await asyncio.wait_for(self.new_version.wait(), timeout=1.0)
        except TimeoutError:
            pass

    async def _group(self, index: int, held: Held) -> None:
        run = self.run_id
        with GROUPS_IN_FLIGHT.labels(run).track_inprogress(), GROUP_SECONDS.labels(run).time(), self._busy():
            await self._run_group(index, held)

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """Count the wall-clock time with any group in flight (groups overlap: their sum would overcount)."""
        if self.in_flight == 0:
            self.busy_since = time.monotonic()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                BUSY_SECONDS.labels(self.run_id).inc(time.monotonic() - self.busy_since)

    async def _run_group(self, index: int, held: Held) -> None:
        group_id = f"{self.run_id}-g{index:05d}-{uuid.uuid4().hex[:8]}"
        try:
            reply = await self.rt.bus.request(
                endpoints.CATALOG_SAMPLE,
                SampleRequest(
                    run_id=self.run_id,
                    taskset=self.config.tasks.taskset,
                    count=1,
                    difficulties=self.config.tasks.difficulties,
                    seed=self.config.seed * 1_000_003 + index,
                    sampling=self.config.tasks.sampling,
                ),
                timeout=30,
            )
            task = reply.tasks[0]
        except Exception as exc:  # nothing was generated: give the slot back and let a later try use it
            await self._group_failed(index, "could not sample a task", exc)
            return
        try:
            sessions = await self._group_sandboxes(task)
        except Exception as exc:  # no sandbox for the group: give the slot back and let a later try use it
            await self._group_failed(index, f"could not prepare sandboxes for task {task.task_id}", exc)
            return
        held.release(1)  # the forks' parent is closed
        episodes = [
            self._episode(task, group_id, index * 1000 + i, session) for i, session in enumerate(sessions)
        ]
        results = await asyncio.gather(*episodes, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        for failure in failures:
            self.rt.log.error("episode failed", run_id=self.run_id, group=group_id, error=repr(failure))
        if len(failures) == len(results):  # nothing to publish: the index was spent on nothing
            await self._group_failed(index, f"every episode of task {task.task_id} failed", failures[-1])
            return
        self.failed_groups = 0
        for result in results:
            if isinstance(result, BaseException):
                continue
            try:
                published = await publish_trajectory(self.rt.bus, result, stop=self.rt.stopping)
            except Exception as exc:  # not an outage (that is waited out): the trainer times the group out
                self.rt.log.error(
                    "could not publish", run_id=self.run_id, trajectory=result.trajectory_id, error=repr(exc)
                )
                continue
            if not published:
                self.rt.log.warning(
                    "stopping; trajectory not published", run_id=self.run_id, trajectory=result.trajectory_id
                )
        await self._report()

    async def _group_failed(self, index: int, what: str, exc: BaseException) -> None:
        """A group that produced nothing gives its index back. Unless it failed for an outage, it counts
        toward `max_failed_groups` in a row, after which the run is failed with the reason: the rollouts
        cannot run it (its task set is gone, its snapshots do not unpack, its episodes all fail)."""
        self.rt.log.error(what, run_id=self.run_id, group=index, error=repr(exc))
        try:
            await release(redis=self.rt.redis, run_id=self.run_id, index=index)
        except REDIS_ERRORS as redis_exc:  # the index is lost; the trainer asks for lost groups again
            self.rt.log.warning(
                "could not give a group index back", run_id=self.run_id, error=repr(redis_exc)
            )
        if not isinstance(exc, Unavailable):
            self.failed_groups += 1
            limit = self.settings.max_failed_groups
            if self.failed_groups >= limit:
                # The limit, not the count: groups in flight together fail together, and whichever of
                # them ends the run first (the first end stands) may have counted past it.
                reason = f"the rollouts failed {limit} groups in a row; the last: {what}: {exc}"
                ended = await end_run(
                    self.rt.bus, run_id=self.run_id, status="failed", step=0, version=self.engine.version,
                    error=reason[:ERROR_CHARS], source=self.settings.replica,
                )  # fmt: skip
                self.rt.log.error(
                    "run failed by the rollouts", run_id=self.run_id, status=ended.status, error=reason
                )
                return
        await asyncio.sleep(GROUP_RETRY_S)

    async def _group_sandboxes(self, task) -> list[SandboxSession]:
        """One sandbox prepared from the task snapshot, forked into the group's G copies."""
        prepared = await self.sandboxes.create(
            run_id=self.run_id, task_id=task.task_id, snapshot=task.snapshot, ttl_s=SANDBOX_TTL_S
        )
        async with prepared:
            return await prepared.fork(self.config.schedule.group_size, ttl_s=SANDBOX_TTL_S)

    async def _episode(self, task: TaskSpec, group_id: str, seed: int, session: SandboxSession) -> Trajectory:
        episode = _EpisodeArgs(
            config=self.config,
            task=task,
            session=session,
            run_id=self.run_id,
            group_id=group_id,
            seed=self.config.seed * 7919 + seed,
            replica=self.settings.replica,
            tool_timeout_s=self.settings.tool_timeout_s,
        )
        async with session:
            if self.config.agent.driver == "harness":
                assert isinstance(self.engine, PolicyEngine)  # an ExternalEngine refuses a harness run
                trajectory = await run_harness_episode(
                    episodes=self.episodes_endpoint,
                    command=self.settings.harness_command,
                    timeout_s=self.settings.harness_timeout_s,
                    engine=self.engine,
                    **episode,
                )
            else:
                trajectory = await run_episode(engine=self.engine, **episode)
        EPISODES.labels(self.run_id, trajectory.finish_reason).inc()
        n = arrays(trajectory).num_tokens
        TOKENS.labels(self.run_id).inc(n)
        self.episodes += 1
        self.tokens += n
        return trajectory

    async def _report(self) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        report = RolloutReport(
            replica=self.settings.replica,
            version=self.engine.version,
            episodes=self.episodes,
            tokens=self.tokens,
            tokens_per_s=self.tokens / elapsed,
            episodes_per_min=60 * self.episodes / elapsed,
        )
        event = Event.now(self.run_id, report, source=self.settings.replica)
        try:
            await self.rt.bus.publish(event.subject, event, msg_id=event.msg_id)
        except Unavailable as exc:  # a snapshot of counters: the next report carries them on
            self.rt.log.warning("could not report progress", run_id=self.run_id, error=repr(exc))
