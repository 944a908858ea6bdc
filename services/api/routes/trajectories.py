from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from services.api import queries
from services.api.deps import IdPath, LimitQuery, SessionDep, TextQuery, TimeCursorQuery
from services.api.schemas import MAX_VERSION, Page, TrajectoryDetail, TrajectorySummary

router = APIRouter(prefix="/v1", tags=["trajectories"])


@router.get("/runs/{run_id}/trajectories", responses={404: {"description": "No run with this id."}})
async def get_trajectories(
    run_id: IdPath,
    session: SessionDep,
    limit: LimitQuery = 50,
    cursor: TimeCursorQuery = None,
    min_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    max_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    task_id: TextQuery = None,
    version: Annotated[
        int | None, Query(ge=0, le=MAX_VERSION, description="Has agent tokens from this policy version.")
    ] = None,
    finish_reason: TextQuery = None,
    eval_id: Annotated[
        TextQuery, Query(description="This evaluation's episodes instead of the run's training ones.")
    ] = None,
    resolved: bool | None = None,
) -> Page[TrajectorySummary]:
    """A run's graded training trajectories (or one evaluation's episodes), newest first."""
    filters = queries.TrajectoryFilter(
        min_reward=min_reward,
        max_reward=max_reward,
        task_id=task_id,
        version=version,
        finish_reason=finish_reason,
        eval_id=eval_id,
        resolved=resolved,
    )
    return await queries.list_trajectories(
        session=session, run_id=run_id, limit=limit, cursor=cursor, filters=filters
    )


@router.get("/trajectories/{trajectory_id}", responses={404: {"description": "No trajectory with this id."}})
async def get_trajectory(trajectory_id: IdPath, session: SessionDep) -> TrajectoryDetail:
    """One trajectory in full: text by side and policy version, tool calls, reward and test results."""
    return await queries.get_trajectory(session=session, trajectory_id=trajectory_id)
