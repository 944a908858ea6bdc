from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import Field

from crucible.contracts.inputs import PRINTABLE
from services.api import queries
from services.api.auth import WRITE, WRITE_RESPONSES
from services.api.commands import cancel_run, create_run
from services.api.deps import (
    BusDep,
    ConfigCheckDep,
    IdCursorQuery,
    IdPath,
    LimitQuery,
    NumberCursorQuery,
    SessionDep,
    TimeCursorQuery,
)
from services.api.schemas import (
    CheckpointOut,
    MetricsOut,
    Page,
    RunCreate,
    RunOut,
    StepOut,
    TaskRecordOut,
)

router = APIRouter(prefix="/v1/runs", tags=["runs"])
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "No run with this id."}}
REFUSED_CONFIG: dict[int | str, dict[str, Any]] = {
    422: {
        "description": "A body the schema refuses; a `parallel` layout whose dp_replicate x dp_shard is not"
        " world_size or whose ep does not divide it (the one rule of the run config that JSON Schema cannot"
        " state); or a config the catalog or a sandbox cannot serve (`unservable`, naming the field).",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}},
    }
}


@router.post(
    "",
    status_code=201,
    dependencies=[WRITE],
    responses={**WRITE_RESPONSES, **REFUSED_CONFIG, 503: {"description": "The bus is unavailable."}},
)
async def post_run(body: RunCreate, session: SessionDep, bus: BusDep, check: ConfigCheckDep) -> RunOut:
    """Create a run and announce it to the trainer; a config the catalog cannot serve is a 422."""
    return await create_run(session=session, bus=bus, name=body.name, config=body.config, check=check)


@router.post(
    "/{run_id}/cancel",
    dependencies=[WRITE],
    responses={
        **WRITE_RESPONSES,
        **NOT_FOUND,
        409: {"description": "The run has already ended."},
        503: {"description": "The bus is unavailable."},
    },
)
async def post_cancel(run_id: IdPath, session: SessionDep, bus: BusDep) -> RunOut:
    """End a run now: the rollouts stop admitting its groups, its trainer stops (what it trained stays
    published), and it is `cancelled`."""
    return await cancel_run(session=session, bus=bus, run_id=run_id)


@router.get("")
async def get_runs(
    session: SessionDep,
    limit: LimitQuery = 50,
    cursor: TimeCursorQuery = None,
    status: Literal["created", "running", "finished", "failed", "cancelled"] | None = None,
) -> Page[RunOut]:
    """Runs, newest first."""
    return await queries.list_runs(session=session, limit=limit, cursor=cursor, status=status)


@router.get("/{run_id}", responses=NOT_FOUND)
async def get_run(run_id: IdPath, session: SessionDep) -> RunOut:
    return await queries.get_run(session=session, run_id=run_id)


@router.get("/{run_id}/steps", responses=NOT_FOUND)
async def get_steps(
    run_id: IdPath, session: SessionDep, limit: LimitQuery = 100, cursor: NumberCursorQuery = None
) -> Page[StepOut]:
    """Optimizer steps in order, with their metrics and the trajectories each trained on."""
    return await queries.list_steps(session=session, run_id=run_id, limit=limit, cursor=cursor)


@router.get("/{run_id}/metrics", responses=NOT_FOUND)
async def get_metrics(
    run_id: IdPath,
    session: SessionDep,
    name: Annotated[
        list[Annotated[str, Field(max_length=200, pattern=PRINTABLE)]],
        Query(max_length=100, description="Only these metrics (repeatable); all when omitted."),
    ] = [],  # noqa: B006 - FastAPI copies a query default for each request
) -> MetricsOut:
    """Every numeric step metric (loss, reward_mean, staleness_mean, ...) as a series over steps."""
    return await queries.metric_series(session=session, run_id=run_id, names=name or None)


@router.get("/{run_id}/checkpoints", responses=NOT_FOUND)
async def get_checkpoints(
    run_id: IdPath, session: SessionDep, limit: LimitQuery = 100, cursor: NumberCursorQuery = None
) -> Page[CheckpointOut]:
    """Published weight versions, oldest first."""
    return await queries.list_checkpoints(session=session, run_id=run_id, limit=limit, cursor=cursor)


@router.get("/{run_id}/tasks", responses=NOT_FOUND)
async def get_task_records(
    run_id: IdPath, session: SessionDep, limit: LimitQuery = 100, cursor: IdCursorQuery = None
) -> Page[TaskRecordOut]:
    """The run's record on each task it has graded training episodes of, by task id: episodes and
    resolved ones, overall and recently (the pass rate `tasks.sampling = "learnable"` weighs tasks by)."""
    return await queries.list_task_records(session=session, run_id=run_id, limit=limit, cursor=cursor)
