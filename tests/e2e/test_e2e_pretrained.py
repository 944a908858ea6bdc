"""A run that starts from SmolLM2-135M-Instruct (its package) through every real service: the trainer
publishes the imported weights as version 0, rollouts act in the model's chat template with tool calls
under the grammar, the grader grades, the trainer replays the grammar and trains, new versions flow back."""

from __future__ import annotations

import httpx
import pytest
from run_wait import wait_until_ended

from crucible.localstack import LocalStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
# ENTROPY: a step skips trajectories whose advantage is 0 unless an entropy or KL term reaches them; a
# tiny entropy term makes every trajectory run, so the on-policy ratio is measured whatever the rewards.
CONFIG = {
    "model": {"source": "package:smollm2-135m-instruct"},
    "agent": {"max_turns": 2, "max_action_tokens": 64, "max_observation_bytes": 400},
    "optim": {"learning_rate": 1e-6, "entropy_coef": 1e-6},  # entropy: see ENTROPY
    "schedule": {
        "group_size": 2,
        "groups_per_step": 1,
        "max_steps": 2,
        "publish_every": 1,
        "max_staleness": 1,
    },
    "tasks": {"difficulties": [1]},
}


def test_a_pretrained_model_trains_publishes_and_rolls_out(stack: LocalStack, tmp_path) -> None:
    client = httpx.Client(base_url=stack.api_url, headers=stack.api_headers, timeout=30)
    created = client.post("/v1/runs", json={"name": "smollm2", "config": CONFIG})
    assert created.status_code == 201, created.text
    run_id = created.json()["run_id"]
    run = wait_until_ended(stack, client, run_id, timeout=900)
    assert run["status"] == "finished", run
    trajectories = client.get(f"/v1/runs/{run_id}/trajectories", params={"limit": 100}).json()["items"]
    steps = client.get(f"/v1/runs/{run_id}/steps").json()["items"]
    checkpoints = client.get(f"/v1/runs/{run_id}/checkpoints").json()["items"]
    detail = client.get(f"/v1/trajectories/{trajectories[0]['trajectory_id']}").json()
    # the transcript shows the model's own text: its chat template and its tool call
    agent_text = "".join(s["text"] for s in detail["segments"] if s["role"] == "agent")
    assert agent_text.startswith("<tool_call>") and "<|im_start|>" in detail["segments"][0]["text"]
    assert [c["version"] for c in checkpoints] == [0, 1, 2]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(t["num_tool_calls"] >= 1 for t in trajectories)
    assert max(t["version_max"] for t in trajectories) >= 1  # rollouts swapped in a trained version
    # on-policy tokens: the trainer's replayed grammar gives the sampler's logprobs
    assert all(s["metrics"]["ratio_p50"] == pytest.approx(1.0, abs=1e-2) for s in steps)
