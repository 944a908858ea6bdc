from __future__ import annotations

from fastapi import APIRouter

from services.api import queries
from services.api.auth import WRITE, WRITE_RESPONSES
from services.api.commands import create_eval
from services.api.deps import BusDep, IdPath, LimitQuery, SessionDep, TimeCursorQuery
from services.api.schemas import EvalCreate, EvalOut, Page

router = APIRouter(tags=["evaluations"])


@router.post(
    "/v1/evals",
    status_code=201,
    dependencies=[WRITE],
    responses={**WRITE_RESPONSES, 404: {"description": "No such run, or it has not published that version."},
               503: {"description": "The bus is unavailable."}},
)  # fmt: skip
async def post_eval(body: EvalCreate, session: SessionDep, bus: BusDep) -> EvalOut:
    """Evaluate a published weight version on a held-out split: a greedy episode and `samples` sampled
    ones per task, through the rollout, sandbox and grader services. Poll the returned evaluation."""
    eval_id = await create_eval(session=session, bus=bus, body=body)
    return await queries.get_eval(session=session, eval_id=eval_id)


@router.get("/v1/evals/{eval_id}", responses={404: {"description": "No evaluation with this id."}})
async def get_eval(eval_id: IdPath, session: SessionDep) -> EvalOut:
    """An evaluation: its status, pass@1, pass@k and resolved rate with 95% intervals, quality measures."""
    return await queries.get_eval(session=session, eval_id=eval_id)


@router.get("/v1/runs/{run_id}/evals", responses={404: {"description": "No run with this id."}})
async def get_run_evals(
    run_id: IdPath, session: SessionDep, limit: LimitQuery = 100, cursor: TimeCursorQuery = None
) -> Page[EvalOut]:
    """The run's evaluations, oldest first."""
    return await queries.list_evals(session=session, run_id=run_id, limit=limit, cursor=cursor)
