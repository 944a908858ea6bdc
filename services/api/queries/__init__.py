"""Reads behind the REST API: plain functions, keyword-only, usable from routes, tests and scripts."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.db.models import Run


class NotFound(LookupError):
    """An id that names nothing; the message says what was looked for."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


async def require_run(session: AsyncSession, run_id: str) -> None:
    if await session.scalar(select(Run.run_id).where(Run.run_id == run_id)) is None:
        raise NotFound(f"run {run_id!r} not found")


from services.api.queries.runs import get_run, list_checkpoints, list_runs, list_steps, metric_series  # noqa: E402
from services.api.queries.trajectories import TrajectoryFilter, get_trajectory, list_trajectories  # noqa: E402

__all__ = [
    "NotFound",
    "TrajectoryFilter",
    "get_run",
    "get_trajectory",
    "list_checkpoints",
    "list_runs",
    "list_steps",
    "list_trajectories",
    "metric_series",
    "require_run",
]
