"""Run events into the run history: `run.status`, `step` (with the trajectories it trained on),
`checkpoint`, `eval` and `sft` (the warm start, on the run). Each is idempotent: a step or checkpoint is
written once per key, a finished or failed run does not reopen, and an evaluation's status only moves
forward."""

from __future__ import annotations

from collections import Counter

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.contracts.events import (
    TERMINAL_STATUSES,
    CheckpointPublished,
    EvalReport,
    Event,
    RunStatus,
    StepReport,
    WarmStartReport,
)
from crucible.contracts.messages import EvalRequest
from crucible.db.models import Checkpoint, Evaluation, Run, Step, StepTrajectory, utcnow
from crucible.db.statements import insert_or_ignore
from services.api.records.common import known_run, log, when


async def apply_event(*, session: AsyncSession, event: Event) -> None:
    """Apply one run event: `run.status`, `step`, `checkpoint`, `eval` or `sft`; other kinds are not
    stored."""
    data = event.data
    if not isinstance(data, RunStatus | StepReport | CheckpointPublished | EvalReport | WarmStartReport):
        return
    run = await known_run(session, event.run_id, f"{event.kind} event")
    if run is None:
        return
    if isinstance(data, RunStatus):
        _set_status(run, data)
    elif isinstance(data, StepReport):
        await _record_step(session, event, data)
    elif isinstance(data, EvalReport):
        await _record_eval(session, data)
    elif isinstance(data, WarmStartReport):
        run.warm_start = msgspec.to_builtins(data)
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
            kind=data.weights,
            base_version=data.base_version,
            raw_bytes=data.raw_bytes,
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


EVAL_ORDER = {"requested": 0, "running": 1, "done": 2, "failed": 2}


async def add_evaluation(session: AsyncSession, request: EvalRequest, *, when_ts: float) -> bool:
    """The evaluation's row, once (True if it was new)."""
    return await insert_or_ignore(
        session,
        Evaluation,
        eval_id=request.eval_id,
        run_id=request.run_id,
        version=request.version,
        taskset=request.taskset,
        split=request.split,
        samples=request.samples,
        max_tasks=request.max_tasks,
        source=request.source,
        status="requested",
        failed_episodes=0,
        created_at=when(when_ts),
        updated_at=utcnow(),
    )


async def _record_eval(session: AsyncSession, data: EvalReport) -> None:
    await add_evaluation(session, data.request, when_ts=data.request.requested_at)
    row = await session.get(Evaluation, data.request.eval_id)
    assert row is not None
    if EVAL_ORDER[data.status] < EVAL_ORDER[row.status] or row.status in ("done", "failed"):
        return
    row.status = data.status
    if data.status in ("running", "done"):
        row.tasks, row.expected = data.tasks, data.expected
        row.failed_episodes = data.failed_episodes
    if data.error:
        row.error = data.error
