"""A short run through every real service, checked over the REST API: each trajectory graded once and
trained on at most once, metrics and checkpoints recorded, weights versions used by the rollouts, and a
malformed message on the grader's stream dead-lettered. (Services killed mid-run, and servers
restarted, are test_e2e_chaos's.)"""

from __future__ import annotations

import asyncio
import time

import httpx
import nats
import pytest

from crucible.contracts import subjects
from crucible.localstack import LocalStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONFIG = {
    "schedule": {
        "group_size": 2,
        "groups_per_step": 2,
        "max_steps": 5,
        "publish_every": 1,
        "max_staleness": 1,
    },
    "agent": {"max_turns": 2},
    "reward": {"quality": {"lint": 0.2}},
}


def pages(client: httpx.Client, path: str, **params) -> list[dict]:
    items, cursor = [], None
    while True:
        page = client.get(path, params={"limit": 7, **params, **({"cursor": cursor} if cursor else {})})
        page.raise_for_status()
        items.extend(page.json()["items"])
        cursor = page.json()["next_cursor"]
        if cursor is None:
            return items


def wait_for(predicate, *, timeout: float, what: str, stack: LocalStack):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = stack.poll()
        assert not dead, f"services exited while waiting for {what}: {dead}"
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


async def stream_state(stack: LocalStack, run_id: str) -> dict[str, int]:
    nc = await nats.connect(**stack.nats_options)
    try:
        js = nc.jetstream()
        rollouts = await js.stream_info(subjects.ROLLOUTS)
        graded = await js.stream_info(subjects.GRADED, subjects_filter=subjects.graded(run_id))
        dead = await js.stream_info(subjects.DEAD_LETTER, subjects_filter="deadletter.>")
        return {
            "rollouts_left": rollouts.state.messages,
            "graded": (graded.state.subjects or {}).get(subjects.graded(run_id), 0),
            "dead_letters": dead.state.messages,
        }
    finally:
        await nc.close()


async def publish_raw(stack: LocalStack, subject: str, data: bytes) -> None:
    """As the operator: a malformed message only a service's bug (or a replayed dead letter) would send."""
    nc = await nats.connect(**stack.nats_options)
    try:
        await nc.jetstream().publish(subject, data)
    finally:
        await nc.close()


def test_short_run_through_every_service(stack: LocalStack, tmp_path):
    client = httpx.Client(base_url=stack.api_url, headers=stack.api_headers, timeout=30)

    bad = {"schedule": {"group_size": 0}, "model": {"precision": "fp4"}}
    bad = client.post("/v1/runs", json={"name": "bad", "config": bad})
    assert bad.status_code == 422
    assert {"group_size", "precision"} <= {e["loc"][-1] for e in bad.json()["detail"]}
    assert client.get("/v1/runs/run-does-not-exist").status_code == 404

    dead_before = asyncio.run(stream_state(stack, "none"))["dead_letters"]  # the stack is shared
    created = client.post("/v1/runs", json={"name": "e2e", "config": CONFIG})
    assert created.status_code == 201, created.text
    run_id = created.json()["run_id"]

    # Mid-run: a malformed message on the grader's stream.
    wait_for(
        lambda: pages(client, f"/v1/runs/{run_id}/trajectories"),
        timeout=300,
        what="a graded trajectory",
        stack=stack,
    )
    asyncio.run(publish_raw(stack, subjects.rollouts(run_id), b"\x93not a trajectory"))

    run = wait_for(
        lambda: (r := client.get(f"/v1/runs/{run_id}").json())["status"] in ("finished", "failed") and r,
        timeout=600,
        what="the run to finish",
        stack=stack,
    )
    assert run["status"] == "finished"
    # Spare groups may still be sampling or grading: every admitted group publishes (the budget is
    # max_steps + 1 steps' worth), so wait until all of them are graded and the work queue is empty.
    schedule = CONFIG["schedule"]
    expected = (schedule["max_steps"] + 1) * schedule["groups_per_step"] * schedule["group_size"]
    state = wait_for(
        lambda: (
            (s := asyncio.run(stream_state(stack, run_id)))["rollouts_left"] == 0
            and s["graded"] >= expected
            and s
        ),
        timeout=180,
        what="every trajectory graded",
        stack=stack,
    )
    wait_for(
        lambda: len(pages(client, f"/v1/runs/{run_id}/trajectories")) == state["graded"],
        timeout=60,
        what="the api to ingest every graded trajectory",
        stack=stack,
    )

    trajectories = pages(client, f"/v1/runs/{run_id}/trajectories")
    steps = pages(client, f"/v1/runs/{run_id}/steps")
    checkpoints = pages(client, f"/v1/runs/{run_id}/checkpoints")
    metrics = client.get(f"/v1/runs/{run_id}/metrics").json()["series"]

    # Nothing lost: everything that entered ROLLOUTS was graded; the only dead letter is the junk.
    assert state["dead_letters"] == dead_before + 1
    assert len(trajectories) == state["graded"] == expected
    # Nothing twice: graded exactly once, trained at most once, and every step's ids are real.
    assert all(t["graded_count"] == 1 for t in trajectories)
    assert all(t["trained_count"] <= 1 for t in trajectories)
    trained = [tid for s in steps for tid in s["trajectory_ids"]]
    assert len(trained) == len(set(trained)) > 0
    assert set(trained) <= {t["trajectory_id"] for t in trajectories}

    assert [s["step"] for s in steps] == list(range(1, schedule["max_steps"] + 1))
    assert {"loss", "reward_mean", "staleness_mean"} <= set(metrics)
    assert len(metrics["loss"]) == schedule["max_steps"]
    assert [c["version"] for c in checkpoints] == list(range(schedule["max_steps"] + 1))
    assert all(
        s["staleness_max"] <= CONFIG["schedule"]["max_staleness"] for s in (st["metrics"] for st in steps)
    )

    # Rollouts ran several weight versions, visible per token in the transcripts.
    versions = {v for t in trajectories for v in (t["version_min"], t["version_max"])}
    assert len(versions) >= 3, versions
    # A step's groups are admitted together: episodes of different groups ran at the same time.
    details = [client.get(f"/v1/trajectories/{t['trajectory_id']}").json() for t in trajectories]
    assert any(
        a["group_id"] != b["group_id"]
        and a["started_at"] < b["finished_at"]
        and b["started_at"] < a["finished_at"]
        for a in details
        for b in details
    ), "every group ran alone"
    detail = details[-1]
    assert detail["tool_calls"], "the agent called tools in its sandbox"
    assert {seg["role"] for seg in detail["segments"]} == {"agent", "environment"}
    assert all(seg["version"] in versions for seg in detail["segments"])
    assert detail["reward_detail"]["fail_to_pass"][1] > 0  # graded against the task's FAIL_TO_PASS tests
    # The run trains with quality terms: every reward has one; a resolved change has its measures.
    assert run["config"]["reward"]["quality"]["lint"] == 0.2
    assert all("quality" in d["reward_detail"]["components"] for d in details)
    resolved = [d["reward_detail"] for d in details if d["reward_detail"]["resolved"]]
    assert all({"lint_introduced", "repetition"} <= set(r["quality"]) for r in resolved)

    # The services stayed up through all of it.
    assert not stack.poll()
    for name in stack.services:
        assert httpx.get(stack.service(name).readyz_url, timeout=5).status_code == 200, name
