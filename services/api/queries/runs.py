"""Reads about runs: the run, its steps, metric series, checkpoints and record on each task."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.db.models import Checkpoint, Run, Step, Trajectory
from crucible.db.task_records import task_records
from services.api.pagination import decode_cursor, encode_cursor, paginate
from services.api.queries.common import NotFound, require_run
from services.api.schemas import (
    CheckpointOut,
    MetricPoint,
    MetricsOut,
    Page,
    RunOut,
    StepOut,
    TaskRecordOut,
)


async def get_run(*, session: AsyncSession, run_id: str) -> RunOut:
    run = await session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id!r} not found")
    return RunOut.model_validate(run)


async def list_runs(
    *, session: AsyncSession, limit: int, cursor: str | None = None, status: str | None = None
) -> Page[RunOut]:
    stmt = select(Run)
    if status is not None:
        stmt = stmt.where(Run.status == status)
    rows, next_cursor = await paginate(
        session=session,
        stmt=stmt,
        keys=[Run.created_at, Run.run_id],
        cursor=cursor,
        limit=limit,
        descending=True,
    )
    return Page[RunOut](items=[RunOut.model_validate(r[0]) for r in rows], next_cursor=next_cursor)


async def list_steps(
    *, session: AsyncSession, run_id: str, limit: int, cursor: str | None = None
) -> Page[StepOut]:
    await require_run(session, run_id)
    stmt = select(Step).where(Step.run_id == run_id)
    rows, next_cursor = await paginate(
        session=session, stmt=stmt, keys=[Step.step], cursor=cursor, limit=limit
    )
    return Page[StepOut](items=[StepOut.model_validate(r[0]) for r in rows], next_cursor=next_cursor)


async def metric_series(*, session: AsyncSession, run_id: str, names: list[str] | None = None) -> MetricsOut:
    """Each numeric step metric as a series over steps."""
    await require_run(session, run_id)
    steps = await session.scalars(select(Step).where(Step.run_id == run_id).order_by(Step.step))
    series: dict[str, list[MetricPoint]] = {}
    for step in steps:
        for name, value in step.metrics.items():
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if numeric and (names is None or name in names):
                series.setdefault(name, []).append(
                    MetricPoint(step=step.step, version=step.version, value=value)
                )
    return MetricsOut(run_id=run_id, series=series)


async def list_checkpoints(
    *, session: AsyncSession, run_id: str, limit: int, cursor: str | None = None
) -> Page[CheckpointOut]:
    await require_run(session, run_id)
    stmt = select(Checkpoint).where(Checkpoint.run_id == run_id)
    rows, next_cursor = await paginate(
        session=session, stmt=stmt, keys=[Checkpoint.version], cursor=cursor, limit=limit
    )
    return Page[CheckpointOut](
        items=[CheckpointOut.model_validate(r[0]) for r in rows], next_cursor=next_cursor
    )


async def list_task_records(
    *, session: AsyncSession, run_id: str, limit: int, cursor: str | None = None
) -> Page[TaskRecordOut]:
    await require_run(session, run_id)
    after = None if cursor is None else decode_cursor(cursor, [Trajectory.task_id])[0]
    records = await task_records(session, run_id, after=after, limit=limit + 1)
    next_cursor = encode_cursor([records[limit - 1].task_id]) if len(records) > limit else None
    return Page[TaskRecordOut](
        items=[TaskRecordOut.model_validate(r) for r in records[:limit]], next_cursor=next_cursor
    )
