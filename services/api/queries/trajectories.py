"""Reads about trajectories: filtered listings and one trajectory's full transcript."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import undefer

from crucible.contracts import decode
from crucible.contracts.messages import GradedTrajectory
from crucible.db.models import StepTrajectory, Trajectory
from services.api import transcript
from services.api.pagination import paginate
from services.api.queries.common import NotFound, require_run
from services.api.schemas import Page, RewardOut, TrajectoryDetail, TrajectorySummary


@dataclass(frozen=True, kw_only=True)
class TrajectoryFilter:
    min_reward: float | None = None
    max_reward: float | None = None
    task_id: str | None = None
    version: int | None = None
    """Trajectories with agent tokens from this policy version (version_min <= v <= version_max)."""
    finish_reason: str | None = None
    eval_id: str | None = None
    """An evaluation's episodes; without it, the run's training episodes only."""
    resolved: bool | None = None


def _with_training(stmt: Select[Any]) -> Select[Any]:
    """Add how often, and first when, each trajectory was trained on (counted from the step links)."""
    links = select(StepTrajectory).where(
        StepTrajectory.trajectory_id == Trajectory.trajectory_id, StepTrajectory.run_id == Trajectory.run_id
    )
    count = links.with_only_columns(func.coalesce(func.sum(StepTrajectory.uses), 0)).scalar_subquery()
    first = links.with_only_columns(func.min(StepTrajectory.step)).scalar_subquery()
    return stmt.add_columns(count, first)


def _summary(row: Any) -> dict[str, Any]:
    traj, trained_count, trained_step = row
    fields = {name: getattr(traj, name) for name in TrajectorySummary.model_fields if hasattr(traj, name)}
    return fields | {
        "num_tool_calls": len(traj.tool_calls),
        "trained_count": int(trained_count),
        "trained_step": trained_step,
    }


async def list_trajectories(
    *,
    session: AsyncSession,
    run_id: str,
    limit: int,
    cursor: str | None = None,
    filters: TrajectoryFilter = TrajectoryFilter(),
) -> Page[TrajectorySummary]:
    await require_run(session, run_id)
    stmt = select(Trajectory).where(Trajectory.run_id == run_id)
    if filters.eval_id is None:
        stmt = stmt.where(Trajectory.eval_id.is_(None))
    else:
        stmt = stmt.where(Trajectory.eval_id == filters.eval_id)
    if filters.resolved is not None:
        stmt = stmt.where(Trajectory.resolved.is_(filters.resolved))
    if filters.min_reward is not None:
        stmt = stmt.where(Trajectory.reward >= filters.min_reward)
    if filters.max_reward is not None:
        stmt = stmt.where(Trajectory.reward <= filters.max_reward)
    if filters.task_id is not None:
        stmt = stmt.where(Trajectory.task_id == filters.task_id)
    if filters.version is not None:
        stmt = stmt.where(
            Trajectory.version_min <= filters.version, Trajectory.version_max >= filters.version
        )
    if filters.finish_reason is not None:
        stmt = stmt.where(Trajectory.finish_reason == filters.finish_reason)
    rows, next_cursor = await paginate(
        session=session,
        stmt=_with_training(stmt),
        keys=[Trajectory.created_at, Trajectory.trajectory_id],
        cursor=cursor,
        limit=limit,
        descending=True,
    )
    items = [TrajectorySummary.model_validate(_summary(r)) for r in rows]
    return Page[TrajectorySummary](items=items, next_cursor=next_cursor)


async def get_trajectory(*, session: AsyncSession, trajectory_id: str) -> TrajectoryDetail:
    """The full transcript: text segments with the policy version of each, tool calls, reward and tests."""
    stmt = _with_training(select(Trajectory).options(undefer(Trajectory.payload)))
    row = (await session.execute(stmt.where(Trajectory.trajectory_id == trajectory_id))).first()
    if row is None:
        raise NotFound(f"trajectory {trajectory_id!r} not found")
    steps = await session.scalars(
        select(StepTrajectory.step)
        .where(StepTrajectory.trajectory_id == trajectory_id)
        .order_by(StepTrajectory.step)
    )
    graded = decode(row[0].payload, GradedTrajectory)
    traj = graded.trajectory
    return TrajectoryDetail.model_validate(
        _summary(row)
        | {
            "segments": transcript.segments(graded),
            "tool_calls": [msgspec.to_builtins(call) for call in traj.tool_calls],
            "token_usage": None if traj.token_usage is None else msgspec.to_builtins(traj.token_usage),
            "reward_detail": RewardOut.model_validate(msgspec.to_builtins(graded.reward)),
            "final_diff": traj.final_diff,
            "rollout_replica": traj.rollout_replica,
            "grader_replica": graded.grader_replica,
            "started_at": traj.started_at,
            "finished_at": traj.finished_at,
            "trained_steps": list(steps),
        }
    )
