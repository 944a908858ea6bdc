"""A run whose episodes an agent harness drives (agent.driver = "harness"): for every episode the rollout
starts Crucible's reference harness, a separate process that speaks only the OpenAI API (the official
client) to the replica's episode endpoint and runs the policy's calls through its tool endpoint; the
rollout records the conversation token for token, the grader grades it and the trainer trains on it,
its replayed grammar giving exactly the sampler's logprobs."""

from __future__ import annotations

import httpx
import pytest
from chat_model import save_chat_model
from run_wait import wait_until_ended

from crucible.localstack import LocalStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_harness_drives_episodes_that_are_graded_and_trained_on(stack: LocalStack, tmp_path) -> None:
    model = save_chat_model(tmp_path / "chat-model")
    config = {
        "model": {"source": str(model), "precision": "bf16"},
        "agent": {"driver": "harness", "max_turns": 2, "max_action_tokens": 96, "max_observation_bytes": 200},
        # every trajectory runs, none skipped for a zero advantage: the on-policy ratio is always measured
        "optim": {"entropy_coef": 1e-6},
        "schedule": {"group_size": 2, "groups_per_step": 1, "max_steps": 1, "publish_every": 1},
        "tasks": {"difficulties": [1]},
    }
    client = httpx.Client(base_url=stack.api_url, headers=stack.api_headers, timeout=30)
    created = client.post("/v1/runs", json={"name": "harness", "config": config})
    assert created.status_code == 201, created.text
    run_id = created.json()["run_id"]
    run = wait_until_ended(stack, client, run_id, timeout=600)
    assert run["status"] == "finished", run
    trajectories = client.get(f"/v1/runs/{run_id}/trajectories", params={"limit": 100}).json()["items"]
    steps = client.get(f"/v1/runs/{run_id}/steps").json()["items"]
    detail = client.get(f"/v1/trajectories/{trajectories[0]['trajectory_id']}").json()
    assert len(trajectories) >= 2 and all(t["reward"] is not None for t in trajectories)
    assert {t["finish_reason"] for t in trajectories} <= {"submitted", "max_turns", "harness_exit", "context"}
    # the transcript is the model's chat template and the policy's own tool call, environment turns between
    roles = [s["role"] for s in detail["segments"]]
    assert roles[0] != "agent" and "agent" in roles
    agent_text = next(s["text"] for s in detail["segments"] if s["role"] == "agent")
    assert agent_text.startswith("<tool_call>"), agent_text
    assert [s["step"] for s in steps] == [1]
    assert sum(t["trained_count"] for t in trajectories) >= 2 and all(
        t["trained_count"] <= 1 for t in trajectories
    )
    # token in, token out: the trainer's forward over the recorded context gives the sampler's logprobs
    assert steps[0]["metrics"]["ratio_p50"] == pytest.approx(1.0, abs=1e-2)
