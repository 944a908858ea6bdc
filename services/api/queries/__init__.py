"""Reads behind the REST API: plain functions, keyword-only, usable from routes, tests and scripts."""

from services.api.queries.common import NotFound, require_run
from services.api.queries.evals import get_eval, list_evals
from services.api.queries.runs import (
    get_run,
    list_checkpoints,
    list_runs,
    list_steps,
    list_task_records,
    metric_series,
)
from services.api.queries.trajectories import TrajectoryFilter, get_trajectory, list_trajectories

__all__ = [
    "NotFound",
    "TrajectoryFilter",
    "get_eval",
    "get_run",
    "get_trajectory",
    "list_checkpoints",
    "list_evals",
    "list_runs",
    "list_steps",
    "list_task_records",
    "list_trajectories",
    "metric_series",
    "require_run",
]
