"""A run whose rollouts sample through an external engine (services.rollout.external), with
`crucible serve --weights-dir` standing in for an SGLang server: every version the trainer publishes is
written where the server reads it and reloaded there, the episodes are graded and trained on, and the
trainer's replayed grammar gives the logprobs the server sampled with."""

from __future__ import annotations

import httpx
import pytest
from chat_model import save_chat_model
from crucible_serve import crucible_serve
from run_wait import wait_until_ended

from crucible.localstack import LocalStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_rollouts_on_an_external_engine_follow_the_trained_versions(tmp_path) -> None:
    model = save_chat_model(tmp_path / "chat-model")
    weights = tmp_path / "weights"
    weights.mkdir()
    config = {
        "model": {"source": str(model), "precision": "bf16"},
        "agent": {"max_turns": 2, "max_action_tokens": 96, "max_observation_bytes": 200},
        # every trajectory runs, none skipped for a zero advantage: the on-policy ratio is always measured
        "optim": {"entropy_coef": 1e-6},
        "schedule": {
            "group_size": 2,
            "groups_per_step": 1,
            "max_steps": 2,
            "publish_every": 1,
            "max_staleness": 0,
        },
        "tasks": {"difficulties": [1]},
    }
    serve = (str(model), "--weights-dir", str(weights), "--precision", "bf16", "--threads", "1")
    with crucible_serve(*serve) as url:
        rollout_env = {
            "CRUCIBLE_ENGINE_URL": url.removesuffix("/v1"),
            "CRUCIBLE_ENGINE_KIND": "sglang",
            "CRUCIBLE_ENGINE_WEIGHTS_DIR": str(weights),
        }
        with LocalStack(
            api_port=0, state_dir=tmp_path / "stack", service_env={"rollout": rollout_env}
        ) as stack:
            client = httpx.Client(base_url=stack.api_url, headers=stack.api_headers, timeout=30)
            created = client.post("/v1/runs", json={"name": "external", "config": config})
            assert created.status_code == 201, created.text
            run_id = created.json()["run_id"]
            run = wait_until_ended(stack, client, run_id, timeout=600)
            assert run["status"] == "finished", run
            trajectories = client.get(f"/v1/runs/{run_id}/trajectories", params={"limit": 100}).json()[
                "items"
            ]
            steps = client.get(f"/v1/runs/{run_id}/steps").json()["items"]
        served = httpx.get(url.removesuffix("/v1") + "/health").json()
    assert [s["step"] for s in steps] == [1, 2]
    assert all(t["reward"] is not None and t["num_tool_calls"] >= 1 for t in trajectories)
    assert max(t["version_max"] for t in trajectories) >= 1  # the server reloaded a trained version
    assert served["version"] >= 1
    assert [p.name for p in (weights / run_id).iterdir()] == [
        f"v{served['version']:06d}"
    ]  # only the newest kept
    # token in, token out: the trainer's forward over the recorded context gives the server's logprobs
    assert all(s["metrics"]["ratio_p50"] == pytest.approx(1.0, abs=1e-2) for s in steps)
