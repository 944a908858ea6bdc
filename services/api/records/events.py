"""Run events into the run history: `run.status`, `step` (with the trajectories it trained on) and
`checkpoint`. Each is idempotent: a step or checkpoint is written once per key, and a finished or
failed run does not reopen."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.contracts import ContractError
from crucible.contracts.messages import Event
from crucible.db.models import RUN_STATUSES, Checkpoint, Run, Step, StepTrajectory, utcnow
from crucible.db.statements import insert_or_ignore
from services.api.records.common import known_run, log, when

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


async def apply_event(*, session: AsyncSession, event: Event) -> None:
    """Apply one run event: `run.status`, `step` or `checkpoint`; other kinds are not stored."""
    if event.kind not in ("run.status", "step", "checkpoint"):
        return
    run = await known_run(session, event.run_id, f"{event.kind} event")
    if run is None:
        return
    if event.kind == "run.status":
        _set_status(run, _data(event, StatusData))
    elif event.kind == "step":
        await _record_step(session, event, _data(event, StepData))
    else:
        data = _data(event, CheckpointData)
        await insert_or_ignore(
            session, Checkpoint, run_id=event.run_id, **msgspec.to_builtins(data), created_at=when(event.ts)
        )
    await session.commit()


def _set_status(run: Run, data: StatusData) -> None:
    if data.status not in RUN_STATUSES:
        raise ContractError(
            f"run {run.run_id}: unknown status {data.status!r}; one of {', '.join(RUN_STATUSES)}"
        )
    if run.status in TERMINAL and data.status != run.status:
        log.warning(
            "ignored status change after the end", run_id=run.run_id, status=run.status, to=data.status
        )
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
        created_at=when(event.ts),
    )
    if not new:
        return
    for trajectory_id, uses in Counter(data.trajectory_ids).items():
        session.add(
            StepTrajectory(run_id=event.run_id, step=data.step, trajectory_id=trajectory_id, uses=uses)
        )
