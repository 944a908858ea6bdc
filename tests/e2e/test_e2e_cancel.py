"""How a run ends other than by finishing. An operator cancels a run over REST: it is `cancelled` at
once, the rollouts stop admitting its groups, its trainer lets go of it (so the next run, which waits
for that trainer, trains and finishes), and a second cancel or an unknown run are 4xx. A run a service
refuses (here the sandbox, whose fork limit is below the run's group size) is failed by the rollouts
with the refusal as its reason, and its trainer lets go of it too."""

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
TOO_WIDE = {"schedule": {"group_size": 3, "groups_per_step": 1, "max_steps": 1, "publish_every": 1}}


def test_a_cancelled_run_ends_and_lets_the_next_one_train(tmp_path) -> None:
    service_env = {
        "trainer": {"CRUCIBLE_MAX_RUNS": "1"},  # the next run waits for the trainer the first holds
        "sandbox": {"CRUCIBLE_MAX_FORK": "2"},  # a run with groups of three is refused
        "rollout": {"CRUCIBLE_MAX_FAILED_GROUPS": "3"},
    }
    with LocalStack(api_port=0, state_dir=tmp_path / "stack", service_env=service_env) as stack:
        client = httpx.Client(base_url=stack.api_url, timeout=30)
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
        cli = crucible("runs", "cancel", endless, "--api", stack.api_url)
        assert cli.returncode == 1 and "already ended (cancelled)" in cli.stderr
        assert client.post("/v1/runs/run-nope/cancel").status_code == 404
        short = client.post("/v1/runs", json={"name": "short", "config": SHORT}).json()["run_id"]
        after = wait_until_ended(stack, client, short, timeout=300)
        run = client.get(f"/v1/runs/{endless}").json()
        listed = client.get("/v1/runs", params={"status": "cancelled"}).json()["items"]

        refused = client.post("/v1/runs", json={"name": "refused", "config": TOO_WIDE}).json()["run_id"]
        failed = wait_until_ended(stack, client, refused, timeout=300)
        last = client.post("/v1/runs", json={"name": "last", "config": SHORT}).json()["run_id"]
        after_failed = wait_until_ended(stack, client, last, timeout=300)
    assert failed["status"] == "failed", failed
    assert "failed 3 groups in a row" in failed["error"] and "count must be 1..2" in failed["error"], failed
    assert after_failed["status"] == "finished", after_failed  # the trainer let go of the failed run
    assert after["status"] == "finished", after
    assert run["status"] == "cancelled" and run["error"] == "cancelled by an operator"
    assert [r["run_id"] for r in listed] == [endless]
