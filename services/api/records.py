"""Run history from the bus into the database, idempotently: at-least-once delivery may repeat any
message, and the tables must look as if each arrived once."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from typing import Any

import msgspec
import structlog
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.contracts import ContractError, encode
from crucible.contracts.messages import Event, GradedTrajectory
from crucible.contracts.packing import unpack
from crucible.db.models import RUN_STATUSES, Checkpoint, Grading, Run, Step, StepTrajectory, Trajectory, utcnow
from crucible.db.statements import insert_or_ignore
from services.api.transcript import agent_versions

log = structlog.get_logger("crucible.api")
TERMINAL = ("finished", "failed")


class StatusData(msgspec.Struct):
    status: str
    error: str | None = None


class StepData(msgspec.Struct):
    step: int
    version: int
    trajectory_ids: list[str] = msgspec.field(default_factory=list)


class CheckpointData(msgspec.Struct):
    version: int
    step: int
    manifest_uri: str
    num_tensors: int = 0
    size_bytes: int = 0


def _data(event: Event, type_: type[Any]) -> Any:
    try:
        return msgspec.convert(event.data, type_)
    except msgspec.ValidationError as exc:
        raise ContractError(f"bad {event.kind!r} event for run {event.run_id}: {exc}") from exc


def _when(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC) if ts > 0 else utcnow()


async def _run(session: AsyncSession, run_id: str, what: str) -> Run | None:
    run = await session.get(Run, run_id)
    if run is None:
        log.warning("skipped: unknown run id", run_id=run_id, message=what)
    return run


def grading_key(graded: GradedTrajectory) -> str:
    """Identifies one grading: a redelivery repeats it exactly, a second grading never does."""
    return f"{graded.graded_at!r}@{graded.grader_replica}"


async def record_graded(*, session: AsyncSession, graded: GradedTrajectory) -> bool:
    """Store a graded trajectory; count a distinct grading once. True if this was a new grading."""
    traj, reward = graded.trajectory, graded.reward
    if await _run(session, traj.run_id, f"graded trajectory {traj.trajectory_id}") is None:
        return False
    try:
        num_tokens = len(unpack("u32", traj.tokens))
        version_min, version_max = agent_versions(graded)
    except ValueError as exc:
        raise ContractError(f"trajectory {traj.trajectory_id}: {exc}") from exc
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
        finish_reason=traj.finish_reason,
        num_tokens=num_tokens,
        version_min=version_min,
        version_max=version_max,
        tool_calls=msgspec.to_builtins(traj.tool_calls),
        payload=encode(graded),
        graded_count=0,
        graded_at=_when(graded.graded_at),
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


async def apply_event(*, session: AsyncSession, event: Event) -> None:
    """Apply one run event: `run.status`, `step` or `checkpoint`; other kinds are not stored."""
    if event.kind not in ("run.status", "step", "checkpoint"):
        return
    run = await _run(session, event.run_id, f"{event.kind} event")
    if run is None:
        return
    if event.kind == "run.status":
        _set_status(run, _data(event, StatusData))
    elif event.kind == "step":
        await _record_step(session, event, _data(event, StepData))
    else:
        data = _data(event, CheckpointData)
        await insert_or_ignore(
            session, Checkpoint, run_id=event.run_id, **msgspec.to_builtins(data), created_at=_when(event.ts)
        )
    await session.commit()


def _set_status(run: Run, data: StatusData) -> None:
    if data.status not in RUN_STATUSES:
        raise ContractError(f"run {run.run_id}: unknown status {data.status!r}; one of {', '.join(RUN_STATUSES)}")
    if run.status in TERMINAL and data.status != run.status:
        log.warning("ignored status change after the end", run_id=run.run_id, status=run.status, to=data.status)
        return
    run.status = data.status
    if data.error:
        run.error = data.error
    if data.status in TERMINAL and run.finished_at is None:
        run.finished_at = utcnow()


async def _record_step(session: AsyncSession, event: Event, data: StepData) -> None:
    """A step and its trajectory links are written together, once per (run, step)."""
    metrics = {k: v for k, v in event.data.items() if k not in ("step", "version", "trajectory_ids")}
    new = await insert_or_ignore(
        session,
        Step,
        run_id=event.run_id,
        step=data.step,
        version=data.version,
        metrics=metrics,
        trajectory_ids=data.trajectory_ids,
        created_at=_when(event.ts),
    )
    if not new:
        return
    for trajectory_id, uses in Counter(data.trajectory_ids).items():
        session.add(StepTrajectory(run_id=event.run_id, step=data.step, trajectory_id=trajectory_id, uses=uses))
