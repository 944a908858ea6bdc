"""The run dashboard: server-rendered pages over the same queries as the REST API.

    /                      runs, newest first
    /runs/{run_id}         the run's curves, evaluations, checkpoints and latest trajectories
    /trajectories/{id}     one transcript: messages by side and policy version, tool calls, reward, tests

The curves are drawn in the browser by uPlot (vendored under static/vendor, MIT) from
`/v1/runs/{run_id}/metrics` and `/v1/runs/{run_id}/evals`; nothing is fetched from outside.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from services.api import queries
from services.api.deps import SessionDep

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")
static = StaticFiles(directory=HERE / "static")
router = APIRouter(include_in_schema=False)

CHARTS = (
    ("reward", "reward (step mean)", ["reward_mean"]),
    ("resolved", "resolved rate (training)", ["resolved_rate"]),
    ("evals", "held-out evaluations (by version)", []),
    ("staleness", "staleness (versions)", ["staleness_mean", "staleness_max"]),
    ("throughput", "throughput (trained tokens / step second)", []),
    ("loss", "loss", ["loss"]),
    ("clip", "clip fraction", ["clip_low_fraction", "clip_high_fraction"]),
    ("kl", "KL to the behaviour policy", ["kl_behaviour"]),
)
"""(id, title, step metrics drawn); evals and throughput are computed by the page's script."""


@router.get("/", response_class=HTMLResponse)
async def runs_page(request: Request, session: SessionDep) -> HTMLResponse:
    page = await queries.list_runs(session=session, limit=100)
    return templates.TemplateResponse(request, "runs.html", {"runs": page.items})


@router.get("/runs/{run_id}", response_class=HTMLResponse)
async def run_page(request: Request, run_id: str, session: SessionDep) -> HTMLResponse:
    run = await queries.get_run(session=session, run_id=run_id)
    checkpoints = await queries.list_checkpoints(session=session, run_id=run_id, limit=100)
    evals = await queries.list_evals(session=session, run_id=run_id, limit=100)
    trajectories = await queries.list_trajectories(session=session, run_id=run_id, limit=20)
    context = {"run": run, "checkpoints": checkpoints.items, "evals": evals.items,
               "trajectories": trajectories.items, "charts": CHARTS}  # fmt: skip
    return templates.TemplateResponse(request, "run.html", context)


@router.get("/trajectories/{trajectory_id}", response_class=HTMLResponse)
async def trajectory_page(request: Request, trajectory_id: str, session: SessionDep) -> HTMLResponse:
    detail = await queries.get_trajectory(session=session, trajectory_id=trajectory_id)
    return templates.TemplateResponse(request, "trajectory.html", {"t": detail})
