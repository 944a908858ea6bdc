"""How a run ends other than by finishing. An operator cancels a run over REST: it is `cancelled` at
once, the rollouts stop admitting its groups, its trainer lets go of it (so the next run, which waits
for that trainer, trains and finishes), and a second cancel or an unknown run are 4xx. A run a service
refuses in a way the api cannot check at creation (here the sandbox, which unpacks no snapshot of more
than one file) is failed by the rollouts with the refusal as its reason, and its trainer lets go of it;
a group wider than a sandbox forks is refused at creation."""

from __future__ import annotations

import time

import httpx
import pytest
from cli_runner import crucible
from run_wait import wait_until_ended

from crucible.localstack import LocalStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ENDLESS = {"schedule": {"group_size": 2, "groups_per_step": 1, "max_steps": 10_000, "publish_every": 1}}
SHORT = {"schedule": {"group_size": 2, "groups_per_step": 1, "max_steps": 1, "publish_every": 1}}


def test_a_cancelled_run_ends_and_lets_the_next_one_train(tmp_path) -> None:
    one_run = {"trainer": {"CRUCIBLE_MAX_RUNS": "1"}}  # the next run waits for the trainer the first holds
    with LocalStack(api_port=0, state_dir=tmp_path / "stack", service_env=one_run) as stack:
        client = httpx.Client(base_url=stack.api_url, headers=stack.api_headers, timeout=30)
        endless = client.post("/v1/runs", json={"name": "endless", "config": ENDLESS}).json()["run_id"]
        deadline = time.monotonic() + 300
        while not client.get(f"/v1/runs/{endless}/steps").json()["items"]:  # observed: it trains
            assert time.monotonic() < deadline, "the run never trained a step"
            time.sleep(0.5)
        cancelled = client.post(f"/v1/runs/{endless}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
        again = client.post(f"/v1/runs/{endless}/cancel")
        assert again.status_code == 409 and "already ended" in again.text
        cli = crucible("runs", "cancel", endless, "--api", stack.api_url,
                       env={"CRUCIBLE_API_KEY": stack.api_key})  # fmt: skip
        assert cli.returncode == 1 and "already ended (cancelled)" in cli.stderr
        assert client.post("/v1/runs/run-nope/cancel").status_code == 404
        short = client.post("/v1/runs", json={"name": "short", "config": SHORT}).json()["run_id"]
        after = wait_until_ended(stack, client, short, timeout=300)
        run = client.get(f"/v1/runs/{endless}").json()
        listed = client.get("/v1/runs", params={"status": "cancelled"}).json()["items"]
    assert after["status"] == "finished", after
    assert run["status"] == "cancelled" and run["error"] == "cancelled by an operator"
    assert [r["run_id"] for r in listed] == [endless]


def test_a_run_a_service_refuses_is_failed_with_the_reason_and_let_go(tmp_path) -> None:
    service_env = {
        "trainer": {"CRUCIBLE_MAX_RUNS": "1"},
        "sandbox": {"CRUCIBLE_MAX_FORK": "2", "CRUCIBLE_MAX_SNAPSHOT_MEMBERS": "1"},
        "rollout": {"CRUCIBLE_MAX_FAILED_GROUPS": "3"},
    }
    with LocalStack(api_port=0, state_dir=tmp_path / "stack", service_env=service_env) as stack:
        client = httpx.Client(base_url=stack.api_url, headers=stack.api_headers, timeout=30)
        wide = {"schedule": {**SHORT["schedule"], "group_size": 3}}
        refused_now = client.post("/v1/runs", json={"name": "wide", "config": wide})
        assert refused_now.status_code == 422, refused_now.text
        (error,) = refused_now.json()["detail"]
        assert error["loc"] == ["body", "config", "schedule", "group_size"] and "at most 2" in error["msg"]
        refused = client.post("/v1/runs", json={"name": "refused", "config": SHORT}).json()["run_id"]
        failed = wait_until_ended(stack, client, refused, timeout=300)
        steps = client.get(f"/v1/runs/{refused}/steps").json()["items"]
        metrics = f"http://127.0.0.1:{stack.service('trainer').http_port}/metrics"
        deadline = time.monotonic() + 60
        while "crucible_trainer_runs 0.0" not in httpx.get(metrics).text:  # observed: the trainer let go
            assert time.monotonic() < deadline, "the trainer still trains the failed run"
            time.sleep(0.2)
    assert failed["status"] == "failed", failed
    assert "failed 3 groups in a row" in failed["error"] and "bad_snapshot" in failed["error"], failed
    assert steps == []
