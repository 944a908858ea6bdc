"""A supervised warm start through every real service, and an RL run that starts from it: `crucible sft`
plays the train split's reference patches in sandboxes (and an imported conversation), trains, and
publishes version 0; the RL run's version 0 is exactly those weights. Both runs write TensorBoard event
files and an MLflow run, read back here with the libraries' own readers (and the RL run a Weights &
Biases offline run)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from browser import dom
from cli_runner import crucible
from test_e2e_run import pages, wait_for

from crucible.bus import Bus
from crucible.clients.checkpoints import load_weights
from crucible.localstack import LocalStack
from crucible.objectstore import ObjectStore
from crucible.settings import CommonSettings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

AGENT = ["agent.max_turns=6", "agent.max_action_tokens=256", "agent.max_observation_bytes=400"]
TRACKERS = 'trackers=["tensorboard", "mlflow"]'
CONVERSATION = {
    "messages": [
        {"role": "user", "content": "Where is the package?"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "list_dir", "arguments": {"path": "."}}}]},
        {"role": "tool", "content": "README.md  (12 bytes)\npkg/"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "submit", "arguments": {}}}]},
    ]
}


async def weights(run_id: str, version: int) -> dict[str, torch.Tensor]:
    settings = CommonSettings()
    store = ObjectStore.from_settings(settings)
    bus = await Bus.connect(settings, store=store, name="test-sft")
    try:
        return (await load_weights(bus=bus, store=store, run_id=run_id, version=version))[1]
    finally:
        await bus.close()


def test_a_warm_start_trains_publishes_and_an_rl_run_starts_from_it(stack: LocalStack, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    demos = tmp_path / "demos.jsonl"
    demos.write_text(json.dumps(CONVERSATION) + "\n")
    env = {
        **stack.settings_env,
        "CRUCIBLE_API_URL": stack.api_url,
        "CRUCIBLE_API_KEY_FILE": str(stack.api_key_file),
    }
    for name, value in stack.settings_env.items():
        monkeypatch.setenv(name, value)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    refused = crucible("sft", "--demos", str(bad), env=env)
    assert refused.returncode == 2 and "line 1" in refused.stderr

    args = ["sft", "--steps", "30", "--tasks", "4", "--demos", str(demos), "--json"]
    for override in [
        *AGENT,
        TRACKERS,
        "tasks.difficulties=[1, 2]",
        "sft.batch_size=4",
        "sft.learning_rate=3e-3",
    ]:
        args += ["--set", override]
    done = crucible(*args, env=env, timeout=900)
    assert done.returncode == 0, done.stderr
    warm = json.loads(done.stdout)
    sft_run = warm["run_id"]
    assert warm["status"] == "finished" and warm["init"] == f"{sft_run}@0"
    # Up to 4 reference demonstrations (the byte-level agent plays one-line edits) and 1 imported.
    assert warm["demonstrations"] + sum(warm["skipped"].values()) <= 5 and warm["demonstrations"] >= 3
    assert warm["steps"] == 30 and warm["loss_last"] < 0.7 * warm["loss_first"]
    client = httpx.Client(base_url=stack.api_url, headers=stack.api_headers, timeout=30)
    assert [c["version"] for c in pages(client, f"/v1/runs/{sft_run}/checkpoints")] == [0]
    assert pages(client, f"/v1/runs/{sft_run}/trajectories") == []  # a warm start alone samples nothing
    page = dom(stack.login_url(f"/runs/{sft_run}"))  # the dashboard shows it, its loss curve drawn
    assert f"{warm['demonstrations']} demonstrations" in page
    assert 'data-points="30"' in page.split('id="chart-sft"', 1)[1].split(">", 1)[0]

    config = {
        "model": {"init": warm["init"]},
        "agent": {"max_turns": 6, "max_action_tokens": 256, "max_observation_bytes": 400},
        "tasks": {"difficulties": [1, 2]},
        "schedule": {"group_size": 2, "groups_per_step": 1, "max_steps": 1, "publish_every": 1},
        "trackers": ["tensorboard", "mlflow", "wandb"],
    }
    rl_run = (
        client.post("/v1/runs", json={"name": "rl", "config": config}).raise_for_status().json()["run_id"]
    )
    wait_for(lambda: client.get(f"/v1/runs/{rl_run}").json()["status"] == "finished", timeout=600,
             what="the RL run to finish", stack=stack)  # fmt: skip
    start, warm_weights = asyncio.run(weights(rl_run, 0)), asyncio.run(weights(sft_run, 0))
    assert start.keys() == warm_weights.keys()
    assert all(torch.equal(start[k], warm_weights[k]) for k in start)

    missing = client.post(
        "/v1/runs", json={"name": "x", "config": {**config, "model": {"init": "run-nope@0"}}}
    )
    missing_id = missing.raise_for_status().json()["run_id"]
    failed = wait_for(
        lambda: (r := client.get(f"/v1/runs/{missing_id}").json())["status"] == "failed" and r,
        timeout=120,
        what="a run with a missing init to fail",
        stack=stack,
    )
    assert "model.init run-nope@0" in failed["error"]
    unreadable = {
        "sft": {"steps": 5, "tasks": 0, "imported": "demonstrations/none.jsonl"},
        "schedule": {"max_steps": 0},
    }
    missing_id = (
        client.post("/v1/runs", json={"name": "x", "config": unreadable}).raise_for_status().json()["run_id"]
    )
    failed = wait_for(
        lambda: (r := client.get(f"/v1/runs/{missing_id}").json())["status"] == "failed" and r,
        timeout=120,
        what="a run with an unreadable sft.imported to fail",
        stack=stack,
    )
    assert "sft.imported demonstrations/none.jsonl cannot be read" in failed["error"]

    assert stack.state_dir is not None
    tracking = stack.state_dir / "tracking"
    sft_events = EventAccumulator(str(tracking / "tensorboard" / sft_run))
    sft_events.Reload()
    losses = [e.value for e in sft_events.Scalars("sft/loss")]
    assert len(losses) == 30 and losses[-1] < losses[0]
    rl_events = EventAccumulator(str(tracking / "tensorboard" / rl_run))
    rl_events.Reload()
    assert [e.step for e in rl_events.Scalars("train/loss")] == [1]
    mlflow = MlflowClient(tracking_uri=f"sqlite:///{tracking / 'mlflow.db'}")
    (experiment,) = [e for e in mlflow.search_experiments() if e.name == "crucible"]
    found = {r.data.tags["crucible.run_id"]: r for r in mlflow.search_runs([experiment.experiment_id])}
    assert set(found) == {sft_run, rl_run}
    assert len(mlflow.get_metric_history(found[sft_run].info.run_id, "sft/loss")) == 30
    history = mlflow.get_metric_history(found[rl_run].info.run_id, "train/resolved_rate")
    assert [m.step for m in history] == [1]
    # Weights & Biases, offline: its run file (read by `wandb sync`; no Python reader ships with it).
    (offline,) = (tracking / "wandb").glob(f"offline-run-*-{rl_run}/run-{rl_run}.wandb")
    assert offline.stat().st_size > 0
