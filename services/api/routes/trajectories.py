from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from services.api import queries
from services.api.deps import CursorQuery, LimitQuery, SessionDep
from services.api.schemas import Page, TrajectoryDetail, TrajectorySummary

router = APIRouter(prefix="/v1", tags=["trajectories"])


@router.get("/runs/{run_id}/trajectories", responses={404: {"description": "No run with this id."}})
async def get_trajectories(
    run_id: str,
    session: SessionDep,
    limit: LimitQuery = 50,
    cursor: CursorQuery = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    task_id: str | None = None,
    version: Annotated[
        int | None, Query(ge=0, description="Has agent tokens from this policy version.")
    ] = None,
    finish_reason: str | None = None,
    eval_id: Annotated[
        str | None, Query(description="This evaluation's episodes instead of the run's training ones.")
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
async def get_trajectory(trajectory_id: str, session: SessionDep) -> TrajectoryDetail:
    """One trajectory in full: text by side and policy version, tool calls, reward and test results."""
    return await queries.get_trajectory(session=session, trajectory_id=trajectory_id)
