"""Evaluations as ingestion writes them and REST scores them: status moves forward only, pass@1 over the
greedy episodes, pass@k over the sampled ones, the resolved rate over all, quality over the resolved."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
from httpx import AsyncClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from crucible.contracts.events import EvalReport, Event
from crucible.contracts.messages import EvalRequest, GradedTrajectory
from services.api.records import apply_event, record_graded

pytestmark = pytest.mark.integration
Maker = async_sessionmaker[AsyncSession]


async def report(sessionmaker: Maker, request: EvalRequest, status: str, **fields: object) -> None:
    event = Event.now(request.run_id, EvalReport(request=request, status=status, **fields), source="t")
    async with sessionmaker() as session:
        await apply_event(session=session, event=event)


async def test_an_evaluation_is_scored_from_its_episodes(
    sessionmaker: Maker, client: AsyncClient, run_id: str, make_graded: Callable[..., GradedTrajectory]
) -> None:
    request = EvalRequest(eval_id="e-1", run_id=run_id, version=2, taskset="pybugs", split="test", samples=2,
                          max_tasks=10, requested_at=1_700_000_000.0, source="schedule")  # fmt: skip
    await report(sessionmaker, request, "requested")
    await report(sessionmaker, request, "running", tasks=2, expected=6)
    await report(sessionmaker, request, "requested")  # late: must not move it back
    seen = (await client.get("/v1/evals/e-1")).json()
    assert seen["status"] == "running" and seen["expected"] == 6 and seen["graded"] == 0
    assert seen["pass_at_1"] == {"value": None, "ci_low": None, "ci_high": None, "n": 0}

    # task A: greedy resolved, samples [yes, no]; task B: nothing resolved.
    outcomes = {
        ("A", 0): True,
        ("A", 1): True,
        ("A", 2): False,
        ("B", 0): False,
        ("B", 1): False,
        ("B", 2): False,
    }
    for (task, sample), resolved in outcomes.items():
        graded = make_graded(run_id, f"e-1-{task}-{sample}", task_id=task, reward=float(resolved))
        trajectory = msgspec.structs.replace(graded.trajectory, eval_id="e-1", eval_sample=sample)
        quality = {"diff_size_ratio": 1.0 + sample, "lint_introduced": 0.0} if resolved else {}
        reward = msgspec.structs.replace(graded.reward, resolved=resolved, quality=quality)
        async with sessionmaker() as session:
            await record_graded(
                session=session, graded=msgspec.structs.replace(graded, trajectory=trajectory, reward=reward)
            )
    await report(sessionmaker, request, "done", tasks=2, expected=6, failed_episodes=0)

    e = (await client.get("/v1/evals/e-1")).json()
    assert e["status"] == "finished" and e["graded"] == 6 and e["source"] == "schedule"
    assert e["pass_at_1"]["value"] == 0.5 and e["pass_at_1"]["n"] == 2
    assert e["pass_at_k"]["value"] == 0.5 and e["pass_at_k"]["n"] == 2
    assert e["resolved_rate"]["value"] == pytest.approx(2 / 6) and e["resolved_rate"]["n"] == 6
    assert e["resolved_rate"]["ci_low"] < 2 / 6 < e["resolved_rate"]["ci_high"]
    assert e["quality"] == {"diff_size_ratio": 1.5, "lint_introduced": 0.0}
    assert e["per_task"] == [
        {"task_id": "A", "greedy_resolved": True, "samples_resolved": 1, "samples_graded": 2},
        {"task_id": "B", "greedy_resolved": False, "samples_resolved": 0, "samples_graded": 2},
    ]
    listed = (await client.get(f"/v1/runs/{run_id}/evals")).json()["items"]
    assert [x["eval_id"] for x in listed] == ["e-1"]
    # The run's trajectories are its training episodes; an evaluation's are asked for by id.
    assert (await client.get(f"/v1/runs/{run_id}/trajectories")).json()["items"] == []
    episodes = (
        await client.get(f"/v1/runs/{run_id}/trajectories", params={"eval_id": "e-1", "resolved": True})
    ).json()
    assert {t["trajectory_id"] for t in episodes["items"]} == {"e-1-A-0", "e-1-A-1"}


async def test_an_evaluation_with_episodes_that_failed_still_finishes(
    sessionmaker: Maker, client: AsyncClient, run_id: str
) -> None:
    request = EvalRequest(eval_id="e-2", run_id=run_id, version=0, taskset="pybugs")
    await report(sessionmaker, request, "done", tasks=1, expected=5, failed_episodes=5)
    e = (await client.get("/v1/evals/e-2")).json()
    assert e["status"] == "finished" and e["failed_episodes"] == 5 and e["pass_at_1"]["value"] is None
    await report(sessionmaker, EvalRequest(eval_id="e-3", run_id=run_id, version=0, taskset="x"), "failed",
                 error="no tasks")  # fmt: skip
    assert (await client.get("/v1/evals/e-3")).json()["error"] == "no tasks"


async def test_bad_evaluation_requests_are_client_errors(client: AsyncClient, run_id: str) -> None:
    assert (await client.post("/v1/evals", json={"run_id": "run-nope"})).status_code == 404
    none_yet = await client.post("/v1/evals", json={"run_id": run_id})
    assert none_yet.status_code == 404 and "has not published any version" in none_yet.json()["detail"]
    assert (await client.post("/v1/evals", json={"run_id": run_id, "split": "dev"})).status_code == 422
    assert (await client.post("/v1/evals", json={"run_id": run_id, "extra": 1})).status_code == 422
    assert (await client.get("/v1/evals/nope")).status_code == 404
    assert (await client.get("/v1/runs/run-nope/evals")).status_code == 404
