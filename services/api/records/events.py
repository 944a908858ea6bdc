"""Run events into the run history: `run.status`, `step` (with the trajectories it trained on) and
`checkpoint`. Each is idempotent: a step or checkpoint is written once per key, and a finished or
failed run does not reopen."""

from __future__ import annotations

from collections import Counter

from sqlalchemy.ext.asyncio import AsyncSession

from crucible.contracts.events import TERMINAL_STATUSES, CheckpointPublished, Event, RunStatus, StepReport
from crucible.db.models import Checkpoint, Run, Step, StepTrajectory, utcnow
from crucible.db.statements import insert_or_ignore
from services.api.records.common import known_run, log, when


async def apply_event(*, session: AsyncSession, event: Event) -> None:
    """Apply one run event: `run.status`, `step` or `checkpoint`; other kinds are not stored."""
    data = event.data
    if not isinstance(data, RunStatus | StepReport | CheckpointPublished):
        return
    run = await known_run(session, event.run_id, f"{event.kind} event")
    if run is None:
        return
    if isinstance(data, RunStatus):
        _set_status(run, data)
    elif isinstance(data, StepReport):
        await _record_step(session, event, data)
    else:
        await insert_or_ignore(
            session,
            Checkpoint,
            run_id=event.run_id,
            version=data.version,
            step=data.step,
            manifest_uri=data.manifest_uri,
            num_tensors=data.num_tensors,
            size_bytes=data.size_bytes,
            created_at=when(event.ts),
        )
    await session.commit()


def _set_status(run: Run, data: RunStatus) -> None:
    if run.status in TERMINAL_STATUSES and data.status != run.status:
        log.warning(
            "ignored status change after the end", run_id=run.run_id, status=run.status, to=data.status
        )
        return
    run.status = data.status
    if data.error:
        run.error = data.error
    if data.status in TERMINAL_STATUSES and run.finished_at is None:
        run.finished_at = utcnow()


async def _record_step(session: AsyncSession, event: Event, data: StepReport) -> None:
    """A step and its trajectory links are written together, once per (run, step)."""
    new = await insert_or_ignore(
        session,
        Step,
        run_id=event.run_id,
        step=data.step,
        version=data.version,
        metrics={
            **data.metrics,
            "dropped_stale_ids": data.dropped_stale_ids,
            "dropped_alone_ids": data.dropped_alone_ids,
        },
        trajectory_ids=data.trajectory_ids,
        created_at=when(event.ts),
    )
    if not new:
        return
    for trajectory_id, uses in Counter(data.trajectory_ids).items():
        session.add(
            StepTrajectory(run_id=event.run_id, step=data.step, trajectory_id=trajectory_id, uses=uses)
        )
