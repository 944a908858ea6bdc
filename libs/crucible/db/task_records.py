"""A run's record on each task it trained on: graded training episodes and how many resolved, overall and
over the task's most recent `RECENT` (evaluation episodes never count). The catalog samples a run's next
tasks by it (`tasks.sampling = "learnable"`); the api serves it (`GET /v1/runs/{run_id}/tasks`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.db.models import Trajectory

RECENT = 16
"""Graded episodes of a task that make its recent pass rate: recent enough to follow the policy."""


@dataclass(frozen=True)
class TaskRecord:
    task_id: str
    attempts: int
    resolved: int
    recent_attempts: int
    recent_resolved: int
    last_graded_at: datetime

    @property
    def pass_rate(self) -> float:
        """Resolved fraction of the task's most recent graded episodes."""
        return self.recent_resolved / self.recent_attempts


async def task_records(
    session: AsyncSession, run_id: str, *, after: str | None = None, limit: int | None = None
) -> list[TaskRecord]:
    """The run's tasks with at least one graded training episode, in task id order: those after task id
    `after`, at most `limit`."""
    ranked = (
        select(
            Trajectory.task_id,
            Trajectory.resolved,
            Trajectory.graded_at,
            func.row_number()
            .over(
                partition_by=Trajectory.task_id,
                order_by=(Trajectory.graded_at.desc(), Trajectory.trajectory_id.desc()),
            )
            .label("age"),
        )
        .where(Trajectory.run_id == run_id, Trajectory.eval_id.is_(None))
        .subquery()
    )
    resolved = case((ranked.c.resolved, 1), else_=0)
    recent = ranked.c.age <= RECENT
    stmt = select(
        ranked.c.task_id,
        func.count(),
        func.sum(resolved),
        func.sum(case((recent, 1), else_=0)),
        func.sum(case((and_(recent, ranked.c.resolved), 1), else_=0)),
        func.max(ranked.c.graded_at),
    ).group_by(ranked.c.task_id)
    if after is not None:
        stmt = stmt.where(ranked.c.task_id > after)
    stmt = stmt.order_by(ranked.c.task_id)
    if limit is not None:
        stmt = stmt.limit(limit)
    rows = (await session.execute(stmt)).all()
    return [
        TaskRecord(
            task_id=task_id, attempts=int(n), resolved=int(r or 0), recent_attempts=int(rn or 0),
            recent_resolved=int(rr or 0), last_graded_at=last,
        )
        for task_id, n, r, rn, rr, last in rows
    ]  # fmt: skip
