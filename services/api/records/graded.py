"""Graded trajectories into the `trajectories` table, each distinct grading counted once."""

from __future__ import annotations

import msgspec
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.contracts import encode
from crucible.contracts.messages import GradedTrajectory
from crucible.contracts.trajectories import arrays, check_graded
from crucible.db.models import Grading, Trajectory
from crucible.db.statements import insert_or_ignore
from services.api.records.common import known_run, log, when
from services.api.transcript import agent_versions


def grading_key(graded: GradedTrajectory) -> str:
    """Identifies one grading: a redelivery repeats it exactly, a second grading never does."""
    return f"{graded.graded_at!r}@{graded.grader_replica}"


async def record_graded(*, session: AsyncSession, graded: GradedTrajectory) -> bool:
    """Store a graded trajectory; count a distinct grading once. True if this was a new grading."""
    traj, reward = graded.trajectory, graded.reward
    check_graded(graded)  # what the detail page decodes must decode: refused here, it is dead-lettered
    if await known_run(session, traj.run_id, f"graded trajectory {traj.trajectory_id}") is None:
        return False
    version_min, version_max = agent_versions(graded)
    await insert_or_ignore(
        session,
        Trajectory,
        trajectory_id=traj.trajectory_id,
        run_id=traj.run_id,
        group_id=traj.group_id,
        task_id=traj.task_id,
        taskset=traj.taskset,
        reward=reward.total,
        tests_passed=reward.tests_passed,
        tests_total=reward.tests_total,
        reward_components=reward.components,
        resolved=reward.resolved,
        eval_id=traj.eval_id or None,
        eval_sample=traj.eval_sample,
        quality=reward.quality,
        finish_reason=traj.finish_reason,
        num_tokens=arrays(traj).num_tokens,
        version_min=version_min,
        version_max=version_max,
        tool_calls=msgspec.to_builtins(traj.tool_calls),
        payload=encode(graded),
        graded_count=0,
        graded_at=when(graded.graded_at),
    )
    key = grading_key(graded)
    new = await insert_or_ignore(
        session, Grading, trajectory_id=traj.trajectory_id, grading_key=key, reward=reward.total
    )
    if new:
        await session.execute(
            update(Trajectory)
            .where(Trajectory.trajectory_id == traj.trajectory_id)
            .values(graded_count=Trajectory.graded_count + 1)
        )
    await session.commit()
    if not new:
        log.info("duplicate grading ignored", trajectory_id=traj.trajectory_id)
    return new
