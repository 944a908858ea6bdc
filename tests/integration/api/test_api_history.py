"""Run history as ingestion writes it (records.py) and REST reads it back."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
from httpx import AsyncClient
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from crucible.contracts import ContractError, decode
from crucible.contracts.events import Event
from crucible.contracts.messages import GradedTrajectory
from crucible.db.models import Checkpoint, Step, Trajectory
from services.api.records import apply_event, record_graded

pytestmark = pytest.mark.integration
Maker = async_sessionmaker[AsyncSession]


async def graded(sessionmaker: Maker, message: GradedTrajectory) -> bool:
    async with sessionmaker() as session:
        return await record_graded(session=session, graded=message)


STEP_FIELDS = {"step", "version", "trajectory_ids", "dropped_stale_ids", "dropped_alone_ids"}


async def event(
    sessionmaker: Maker, run_id: str, kind: str, ts: float = 1_700_000_100.0, **data: object
) -> None:
    """Apply an event as the api's consumer gets it: encoded on the wire, decoded as an Event (a step's
    other fields are its metrics)."""
    if kind == "step":
        metrics = {k: v for k, v in data.items() if k not in STEP_FIELDS}
        data = {k: v for k, v in data.items() if k in STEP_FIELDS} | {"metrics": metrics}
    wire = {"type": "event.v2", "run_id": run_id, "ts": ts, "data": {"kind": kind, **data}}
    async with sessionmaker() as session:
        await apply_event(session=session, event=decode(msgspec.msgpack.encode(wire), Event))


async def test_transcript_shows_text_by_side_and_version_tool_calls_and_reward(
    client: AsyncClient, sessionmaker: Maker, run_id: str, make_graded: Callable[..., GradedTrajectory]
) -> None:
    assert await graded(sessionmaker, make_graded(run_id, "t-1", reward=0.5, versions=(1, 2)))
    await event(sessionmaker, run_id, "step", step=1, version=2, loss=0.3, trajectory_ids=["t-1"])

    body = (await client.get("/v1/trajectories/t-1")).json()
    assert [(s["role"], s["version"], s["text"]) for s in body["segments"]] == [
        ("environment", 1, "<bos>Fix add()"),
        ("agent", 1, "<act><tool:grep>def add"),
        ("environment", 2, "<obs>calc.py:1"),
        ("agent", 2, "<act><tool:submit><end>"),
    ]
    assert body["segments"][1]["token_start"] == body["tool_calls"][0]["token_start"]
    assert body["tool_calls"][0] | {"duration_s": 0} == {
        "index": 0,
        "name": "grep",
        "arguments": "def add",
        "ok": True,
        "output": "calc.py:1",
        "duration_s": 0,
        "token_start": 10,
        "token_end": 19,
        "policy_version": 1,
    }
    assert body["reward"] == 0.5 and body["reward_detail"]["components"] == {"tests": 0.5}
    assert body["reward_detail"]["tests"] == [{"nodeid": "test_calc.py::test_add", "outcome": "passed"}]
    assert (body["version_min"], body["version_max"]) == (1, 2)
    assert body["token_usage"] == {"system": 1, "task": 9, "observations": 10, "actions": 12}
    assert sum(body["token_usage"].values()) == body["num_tokens"]
    assert body["graded_count"] == 1 and body["trained_count"] == 1 and body["trained_steps"] == [1]
    assert body["final_diff"].startswith("--- a/calc.py") and body["grader_replica"] == "grader-a"


async def test_trajectory_filters_and_pages(
    client: AsyncClient, sessionmaker: Maker, run_id: str, make_graded: Callable[..., GradedTrajectory]
) -> None:
    specs = [
        ("t-0", 0.0, "pybugs/1", (0, 0), "done"),
        ("t-1", 0.25, "pybugs/2", (0, 1), "done"),
        ("t-2", 0.5, "pybugs/1", (1, 1), "max_turns"),
        ("t-3", 0.75, "pybugs/2", (1, 2), "done"),
        ("t-4", 1.0, "pybugs/1", (2, 2), "done"),
    ]
    for tid, reward, task, versions, reason in specs:
        await graded(
            sessionmaker,
            make_graded(run_id, tid, reward=reward, task_id=task, versions=versions, finish_reason=reason),
        )

    async def ids(**params: object) -> list[str]:
        body = (await client.get(f"/v1/runs/{run_id}/trajectories", params=params)).json()
        return sorted(item["trajectory_id"] for item in body["items"])

    assert await ids(min_reward=0.5) == ["t-2", "t-3", "t-4"]
    assert await ids(max_reward=0.25) == ["t-0", "t-1"]
    assert await ids(min_reward=0.2, max_reward=0.8, task_id="pybugs/2") == ["t-1", "t-3"]
    assert await ids(version=1) == ["t-1", "t-2", "t-3"]
    assert await ids(finish_reason="max_turns") == ["t-2"]

    seen, cursor = [], None
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        body = (await client.get(f"/v1/runs/{run_id}/trajectories", params=params)).json()
        assert len(body["items"]) <= 2
        seen += [item["trajectory_id"] for item in body["items"]]
        if (cursor := body["next_cursor"]) is None:
            break
    assert sorted(seen) == [s[0] for s in specs] and len(seen) == 5
    summary = body["items"][-1]
    assert (
        summary["num_tool_calls"] == 1 and summary["trained_count"] == 0 and summary["trained_step"] is None
    )


async def test_redelivery_counts_once_and_a_second_grading_counts_twice(
    sessionmaker: Maker, client: AsyncClient, run_id: str, make_graded: Callable[..., GradedTrajectory]
) -> None:
    first = make_graded(run_id, "t-1", graded_at=100.0)
    assert await graded(sessionmaker, first)
    assert not await graded(sessionmaker, first)
    assert (await client.get("/v1/trajectories/t-1")).json()["graded_count"] == 1
    assert await graded(sessionmaker, make_graded(run_id, "t-1", graded_at=200.0, grader_replica="grader-b"))
    assert (await client.get("/v1/trajectories/t-1")).json()["graded_count"] == 2


async def test_training_counts_are_idempotent_per_step_and_survive_any_arrival_order(
    sessionmaker: Maker, client: AsyncClient, run_id: str, make_graded: Callable[..., GradedTrajectory]
) -> None:
    # The step that trains on t-late arrives before t-late itself is ingested.
    await event(
        sessionmaker, run_id, "step", step=1, version=0, loss=0.9, trajectory_ids=["t-once", "t-late"]
    )
    await event(
        sessionmaker, run_id, "step", step=1, version=0, loss=0.9, trajectory_ids=["t-once", "t-late"]
    )
    await event(sessionmaker, run_id, "step", step=2, version=1, loss=0.7, trajectory_ids=["t-twice"])
    await event(sessionmaker, run_id, "step", step=3, version=1, loss=0.5, trajectory_ids=["t-twice"])
    for tid in ("t-once", "t-late", "t-twice", "t-never"):
        await graded(sessionmaker, make_graded(run_id, tid))

    async def trained(tid: str) -> tuple[int, int | None]:
        body = (await client.get(f"/v1/trajectories/{tid}")).json()
        return body["trained_count"], body["trained_step"]

    assert await trained("t-once") == (1, 1)
    assert await trained("t-late") == (1, 1)
    assert await trained("t-twice") == (2, 2)
    assert await trained("t-never") == (0, None)
    async with sessionmaker() as session:
        assert await session.scalar(select(func.count()).select_from(Step)) == 3


async def test_steps_metrics_checkpoints_and_status(
    sessionmaker: Maker, client: AsyncClient, run_id: str
) -> None:
    await event(sessionmaker, run_id, "run.status", status="running")
    for step in (1, 2, 3):
        await event(
            sessionmaker,
            run_id,
            "step",
            step=step,
            version=step // 2,
            loss=1.0 / step,
            reward_mean=0.1 * step,
            staleness_mean=0.5,
            tokens=100 * step,
            trajectory_ids=[],
            dropped_stale_ids=["t-old"],  # stored with the step, not a series
        )
    for _ in range(2):  # the same checkpoint announced twice is recorded once
        await event(
            sessionmaker,
            run_id,
            "checkpoint",
            version=1,
            step=2,
            manifest_uri="s3://crucible/m1.json",
            num_tensors=12,
            size_bytes=3 * 2**31,
        )
    await event(sessionmaker, run_id, "run.status", status="finished")
    await event(sessionmaker, run_id, "run.status", status="running")  # a late duplicate must not reopen it

    steps = (await client.get(f"/v1/runs/{run_id}/steps", params={"limit": 2})).json()
    assert [s["step"] for s in steps["items"]] == [1, 2] and steps["next_cursor"]
    rest = (await client.get(f"/v1/runs/{run_id}/steps", params={"cursor": steps["next_cursor"]})).json()
    assert [s["step"] for s in rest["items"]] == [3] and rest["next_cursor"] is None
    assert steps["items"][0]["metrics"]["loss"] == 1.0

    series = (await client.get(f"/v1/runs/{run_id}/metrics")).json()["series"]
    assert set(series) == {"loss", "reward_mean", "staleness_mean", "tokens"}
    assert [(p["step"], p["version"], p["value"]) for p in series["tokens"]] == [
        (1, 0, 100),
        (2, 1, 200),
        (3, 1, 300),
    ]
    only = (await client.get(f"/v1/runs/{run_id}/metrics", params={"name": "loss"})).json()["series"]
    assert list(only) == ["loss"]

    checkpoints = (await client.get(f"/v1/runs/{run_id}/checkpoints")).json()["items"]
    assert [(c["version"], c["step"], c["size_bytes"]) for c in checkpoints] == [(1, 2, 3 * 2**31)]

    run = (await client.get(f"/v1/runs/{run_id}")).json()
    assert run["status"] == "finished" and run["finished_at"] is not None


async def test_checkpoints_say_which_versions_are_full_and_which_deltas(
    sessionmaker: Maker, client: AsyncClient, run_id: str
) -> None:
    common = {"num_tensors": 272, "raw_bytes": 269_030_016}
    await event(sessionmaker, run_id, "checkpoint", version=0, step=0, manifest_uri="s3://c/0",
                size_bytes=269_060_000, weights="full", **common)  # fmt: skip
    await event(sessionmaker, run_id, "checkpoint", version=1, step=1, manifest_uri="s3://c/1",
                size_bytes=1_790_000, weights="delta", base_version=0, **common)  # fmt: skip
    await event(
        sessionmaker,
        run_id,
        "checkpoint",
        version=2,
        step=2,
        manifest_uri="s3://c/2",
        num_tensors=3,
        size_bytes=9,
    )  # fmt: skip  (from a checkpoints service before deltas)

    checkpoints = (await client.get(f"/v1/runs/{run_id}/checkpoints")).json()["items"]
    assert [
        (c["version"], c["kind"], c["base_version"], c["size_bytes"], c["raw_bytes"]) for c in checkpoints
    ] == [
        (0, "full", None, 269_060_000, 269_030_016),
        (1, "delta", 0, 1_790_000, 269_030_016),
        (2, "full", None, 9, 0),
    ]


async def test_messages_about_unknown_runs_store_nothing(
    sessionmaker: Maker, make_graded: Callable[..., GradedTrajectory]
) -> None:
    assert not await graded(sessionmaker, make_graded("run-ghost", "t-ghost"))
    await event(sessionmaker, "run-ghost", "step", step=1, version=0, trajectory_ids=["t-ghost"])
    await event(sessionmaker, "run-ghost", "checkpoint", version=1, step=1, manifest_uri="s3://x")
    async with sessionmaker() as session:
        for model in (Trajectory, Step, Checkpoint):
            assert await session.scalar(select(func.count()).select_from(model)) == 0


@pytest.mark.parametrize(
    ("kind", "data", "message"),
    [
        ("step", {"version": 0}, "not a valid Event: Object missing required field `step` - at `\\$.data`"),
        ("checkpoint", {"version": "one", "step": 1, "manifest_uri": "s3://x"}, "Expected `int`, got `str`"),
        ("run.status", {"status": "paused"}, "Invalid enum value 'paused'"),
        ("step", {"step": 1, "version": 0, "note": "text"}, "Expected `float`, got `str`"),
    ],
)
async def test_invalid_event_content_is_a_contract_error(
    sessionmaker: Maker, run_id: str, kind: str, data: dict, message: str
) -> None:
    with pytest.raises(ContractError, match=message):
        await event(sessionmaker, run_id, kind, **data)


async def test_a_runs_tasks_show_its_record_on_each_and_page(
    client: AsyncClient, sessionmaker: Maker, run_id: str, make_graded: Callable[..., GradedTrajectory]
) -> None:
    episodes = [("pybugs/1", True), ("pybugs/1", False), ("pybugs/2", False), ("pybugs/3", True)]
    for i, (task_id, resolved) in enumerate(episodes):
        message = make_graded(run_id, f"t-{i}", task_id=task_id, graded_at=1_700_000_000.0 + i)
        reward = msgspec.structs.replace(message.reward, resolved=resolved)
        await graded(sessionmaker, msgspec.structs.replace(message, reward=reward))
    body = (await client.get(f"/v1/runs/{run_id}/tasks")).json()
    assert [(t["task_id"], t["attempts"], t["resolved"], t["pass_rate"]) for t in body["items"]] == [
        ("pybugs/1", 2, 1, 0.5), ("pybugs/2", 1, 0, 0.0), ("pybugs/3", 1, 1, 1.0),
    ]  # fmt: skip
    first = (await client.get(f"/v1/runs/{run_id}/tasks", params={"limit": 2})).json()
    assert [t["task_id"] for t in first["items"]] == ["pybugs/1", "pybugs/2"]
    rest = await client.get(f"/v1/runs/{run_id}/tasks", params={"limit": 2, "cursor": first["next_cursor"]})
    assert [t["task_id"] for t in rest.json()["items"]] == ["pybugs/3"] and rest.json()["next_cursor"] is None
    assert (await client.get("/v1/runs/run-nope/tasks")).status_code == 404
