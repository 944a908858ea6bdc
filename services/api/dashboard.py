"""The run dashboard: server-rendered pages over the same queries as the REST API.

    /                      runs, newest first
    /runs/{run_id}         the run's curves, evaluations, checkpoints, tasks and latest trajectories
    /trajectories/{id}     one transcript: messages by side and policy version, tool calls, reward, tests
    /login?key=&next=      keep an API key in an HttpOnly, SameSite=Strict cookie (good for reads only)
    /logout                forget it

Every page needs a key (bearer or the cookie); without one it sends the browser to /login.

The curves are drawn in the browser by uPlot (vendored under static/vendor, MIT) from
`/v1/runs/{run_id}/metrics` and `/v1/runs/{run_id}/evals`; nothing is fetched from outside.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from crucible.apikeys import KeyInfo
from services.api import queries
from services.api.auth import COOKIE, Bearer, Cookie, lookup, reader
from services.api.deps import SessionDep

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")
static = StaticFiles(directory=HERE / "static")


class LoginNeeded(Exception):
    """A page asked for without a usable key: the browser goes to /login, then back."""


async def _viewer(request: Request, credentials: Bearer, from_cookie: Cookie) -> KeyInfo:
    try:
        return await reader(request, credentials, from_cookie)
    except HTTPException as exc:
        if exc.status_code == 401:
            raise LoginNeeded from exc
        raise


async def login_needed(request: Request, _exc: Exception) -> Response:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(request.url_for("login").include_query_params(next=target), status_code=303)


router = APIRouter(include_in_schema=False)
pages = APIRouter(include_in_schema=False, dependencies=[Depends(_viewer)])

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


@pages.get("/", response_class=HTMLResponse)
async def runs_page(request: Request, session: SessionDep) -> HTMLResponse:
    page = await queries.list_runs(session=session, limit=100)
    return templates.TemplateResponse(request, "runs.html", {"runs": page.items})


@pages.get("/runs/{run_id}", response_class=HTMLResponse)
async def run_page(request: Request, run_id: str, session: SessionDep) -> HTMLResponse:
    run = await queries.get_run(session=session, run_id=run_id)
    checkpoints = await queries.list_checkpoints(session=session, run_id=run_id, limit=100)
    evals = await queries.list_evals(session=session, run_id=run_id, limit=100)
    trajectories = await queries.list_trajectories(session=session, run_id=run_id, limit=20)
    tasks = await queries.list_task_records(session=session, run_id=run_id, limit=500)
    context = {"run": run, "checkpoints": checkpoints.items, "evals": evals.items,
               "trajectories": trajectories.items, "tasks": tasks.items, "charts": CHARTS}  # fmt: skip
    return templates.TemplateResponse(request, "run.html", context)


@pages.get("/trajectories/{trajectory_id}", response_class=HTMLResponse)
async def trajectory_page(request: Request, trajectory_id: str, session: SessionDep) -> HTMLResponse:
    detail = await queries.get_trajectory(session=session, trajectory_id=trajectory_id)
    return templates.TemplateResponse(request, "trajectory.html", {"t": detail})


def _local(path: str) -> str:
    """`path` when it is a path on this server, else `/` (no open redirect to another site)."""
    return path if path.startswith("/") and not path.startswith(("//", "/\\")) else "/"


@router.get("/login", response_class=HTMLResponse, name="login")
async def login(
    request: Request,
    key: Annotated[str | None, Query(max_length=200)] = None,
    next: Annotated[str, Query(max_length=2000)] = "/",  # the parameter's name in the URL
) -> Response:
    """With `key`: check it, keep it in the cookie and go on to `next`; without: a form asking for one."""
    error = None
    if key:
        if await lookup(request, key.strip()) is not None:
            response = RedirectResponse(_local(next), status_code=303)
            response.set_cookie(COOKIE, key.strip(), httponly=True, samesite="strict", path="/")
            return response
        error = "That key is malformed, unknown or revoked."
    context = {"next": _local(next), "error": error}
    return templates.TemplateResponse(request, "login.html", context, status_code=401 if error else 200)


@router.get("/logout")
async def logout() -> Response:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response


router.include_router(pages)
