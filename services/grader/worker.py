"""One delivery of a trajectory: grade it once, publish the result, remember that it is done.

Exactly-once grading rests on JetStream: the graded message's id is the trajectory id, so a second
publish of the same trajectory (a redelivery after a crash, a second replica) is dropped as a duplicate.
The Redis marker only spares a redelivered trajectory the sandbox work; losing Redis loses nothing.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from crucible.bus import Bus, Delivery
from crucible.contracts import subjects
from crucible.contracts.keys import graded_claim_prefix, graded_key
from crucible.contracts.messages import GradedTrajectory, Trajectory
from services.grader.grading import RunConfigs, grade
from services.grader.metrics import GRADE_SECONDS, REWARD, TRAJECTORIES
from services.grader.settings import Settings

log = structlog.get_logger("crucible.grader")


async def already_graded(*, redis: aioredis.Redis, trajectory_id: str) -> bool:
    try:
        return bool(await redis.exists(graded_key(trajectory_id)))
    except RedisError as exc:
        log.warning("redis unavailable; grading anyway", error=str(exc))
        return False


async def mark_graded(*, redis: aioredis.Redis, trajectory_id: str, ttl_s: int) -> None:
    try:
        await redis.set(graded_key(trajectory_id), b"1", ex=ttl_s)
    except RedisError as exc:
        log.warning("redis unavailable; graded marker not set", error=str(exc))


async def handle_trajectory(
    *,
    trajectory: Trajectory,
    delivery: Delivery,
    bus: Bus,
    redis: aioredis.Redis,
    configs: RunConfigs,
    settings: Settings,
) -> None:
    tid = trajectory.trajectory_id
    bound = log.bind(
        run_id=trajectory.run_id, trajectory_id=tid, task_id=trajectory.task_id, attempt=delivery.attempt
    )
    if await already_graded(redis=redis, trajectory_id=tid):
        TRAJECTORIES.labels(result="duplicate").inc()
        bound.info("already graded; skipped")
        return
    started = time.monotonic()
    async with delivery.keep_alive(every_s=settings.heartbeat_s):
        config = await configs.get(trajectory.run_id)
        reward = await grade(bus=bus, trajectory=trajectory, config=config, settings=settings)
    graded = GradedTrajectory(
        trajectory=trajectory, reward=reward, graded_at=time.time(), grader_replica=settings.replica
    )
    fresh = await bus.publish(
        subjects.graded(trajectory.run_id),
        graded,
        msg_id=tid,
        claim_prefix=graded_claim_prefix(trajectory.run_id, tid),
    )
    await mark_graded(redis=redis, trajectory_id=tid, ttl_s=settings.graded_key_ttl_s)
    GRADE_SECONDS.observe(time.monotonic() - started)
    TRAJECTORIES.labels(result="graded" if fresh else "duplicate").inc()
    if fresh:
        REWARD.observe(reward.total)
    bound.info("graded", reward=round(reward.total, 4), passed=reward.tests_passed, total=reward.tests_total,
               note=reward.note, duplicate=not fresh)  # fmt: skip
