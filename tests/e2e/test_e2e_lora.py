"""A LoRA run (model.lora) through every real service: the trainer trains adapters on a frozen chat model,
each version after the first is a delta that carries the adapters and little else, rollouts load the
adapted model, and the trainer recomputes the sampler's logprobs on tokens the trained adapters made."""

from __future__ import annotations

import httpx
import pytest
from chat_model import save_chat_model
from run_wait import wait_until_ended

from crucible.contracts.runconfig import RunConfig
from crucible.localstack import LocalStack
from crucible.model.lora import is_adapter
from crucible.model.spec import PolicySpec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_lora_run_trains_adapters_that_rollouts_sample_with(stack: LocalStack, tmp_path) -> None:
    model = save_chat_model(tmp_path / "chat-model")
    config = {
        "model": {"source": str(model), "precision": "bf16", "lora": {"rank": 4, "alpha": 8}},
        "agent": {"max_turns": 2, "max_action_tokens": 48, "max_observation_bytes": 200},
        # lr: the adapters move visibly in one step; entropy: every trajectory runs (none skipped for a
        # zero advantage), so the on-policy ratio is measured whatever the rewards
        "optim": {"learning_rate": 1e-2, "entropy_coef": 1e-6},
        # staleness 0: step 2 trains only on episodes version 1 sampled, with adapters already trained
        "schedule": {"group_size": 2, "groups_per_step": 1, "max_steps": 2, "publish_every": 1,
                     "max_staleness": 0},
        "tasks": {"difficulties": [1]},
    }  # fmt: skip
    client = httpx.Client(base_url=stack.api_url, headers=stack.api_headers, timeout=30)
    created = client.post("/v1/runs", json={"name": "lora", "config": config})
    assert created.status_code == 201, created.text
    run_id = created.json()["run_id"]
    run = wait_until_ended(stack, client, run_id, timeout=600)
    assert run["status"] == "finished", run
    steps = client.get(f"/v1/runs/{run_id}/steps").json()["items"]
    checkpoints = client.get(f"/v1/runs/{run_id}/checkpoints").json()["items"]
    trajectories = client.get(f"/v1/runs/{run_id}/trajectories", params={"limit": 100}).json()["items"]

    assert [s["step"] for s in steps] == [1, 2]
    assert [(c["version"], c["kind"], c["base_version"]) for c in checkpoints] == [
        (0, "full", None), (1, "delta", 0), (2, "delta", 0),
    ]  # fmt: skip
    adapted = PolicySpec.resolve(RunConfig.model_validate(config)).empty_model()
    adapters = [t for k, t in adapted.state_dict().items() if is_adapter(k)]
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters)
    for delta in checkpoints[1:]:  # the adapters' bytes, and zstd frames of the unchanged base's zeros
        assert delta["size_bytes"] <= adapter_bytes + 0.01 * delta["raw_bytes"], (delta, adapter_bytes)
    assert any(t["version_max"] == 1 for t in trajectories)
    # on-policy tokens, before and after the adapters moved: the rollouts ran the adapted model
    assert all(s["metrics"]["ratio_p50"] == pytest.approx(1.0, abs=1e-2) for s in steps), steps
    assert steps[1]["metrics"]["ratio_max"] == pytest.approx(1.0, abs=5e-2)
