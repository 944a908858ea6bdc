"""Imported SWE-bench-format tasks trained on and evaluated through every real service: `crucible tasks
import` into a running stack, a run on the imported train split that evaluates itself every version,
an evaluation asked for with `crucible eval`, each scored over REST and shown by `crucible runs show`."""

from __future__ import annotations

import json

import httpx
import pytest
import swebench_repos
from browser import dom
from cli_runner import crucible
from test_e2e_run import pages, wait_for

from crucible.localstack import LocalStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONFIG = {
    "tasks": {"taskset": "imported", "difficulties": [1, 2, 3]},
    "schedule": {
        "group_size": 2,
        "groups_per_step": 1,
        "max_steps": 2,
        "publish_every": 1,
        "max_staleness": 1,
    },
    "agent": {"max_turns": 2},
    "eval": {"every_versions": 1, "at_end": True, "samples": 1},
}


def test_imported_tasks_are_trained_on_and_evaluated(stack: LocalStack, tmp_path):
    env = {
        **stack.settings_env,
        "CRUCIBLE_API_URL": stack.api_url,
        "CRUCIBLE_API_KEY_FILE": str(stack.api_key_file),
    }
    mirrors, good = swebench_repos.build(tmp_path / "repos")
    instances = tmp_path / "instances.jsonl"
    instances.write_text(swebench_repos.jsonl(good))
    imported = crucible(
        "tasks",
        "import",
        str(instances),
        "--repos",
        str(mirrors),
        "--taskset",
        "imported",
        "--json",
        env=env,
        timeout=600,
    )
    assert imported.returncode == 0, imported.stderr
    report = json.loads(imported.stdout)
    assert report["verified"] == 5 and set(report["splits"]) == {"train", "test"}
    held_out = report["splits"]["test"]

    client = httpx.Client(base_url=stack.api_url, headers=stack.api_headers, timeout=30)
    run_id = (
        client.post("/v1/runs", json={"name": "eval", "config": CONFIG}).raise_for_status().json()["run_id"]
    )
    wait_for(
        lambda: pages(client, f"/v1/runs/{run_id}/checkpoints"),
        timeout=300,
        what="version 0",
        stack=stack,
    )
    asked = crucible("eval", "--run", run_id, "--version", "0", "--json", env=env, timeout=900)
    assert asked.returncode == 0, asked.stderr
    on_demand = json.loads(asked.stdout)
    assert on_demand["status"] == "finished" and on_demand["version"] == 0 and on_demand["source"] == "api"

    wait_for(lambda: client.get(f"/v1/runs/{run_id}").json()["status"] == "finished", timeout=600,
             what="the run to finish", stack=stack)  # fmt: skip
    evals = wait_for(
        lambda: (
            len(e := pages(client, f"/v1/runs/{run_id}/evals")) == 3
            and all(x["status"] == "finished" for x in e)
            and e
        ),
        timeout=600,
        what="every evaluation to finish",
        stack=stack,
    )
    assert sorted((e["version"], e["source"]) for e in evals) == [
        (0, "api"),
        (1, "schedule"),
        (2, "schedule"),
    ]
    for e in evals:
        assert e["taskset"] == "imported" and e["split"] == "test" and e["tasks"] == held_out
        assert e["expected"] == e["graded"] == held_out * 2 and e["failed_episodes"] == 0
        assert e["pass_at_1"]["n"] == held_out and e["pass_at_k"]["n"] == held_out
        assert (
            0.0
            <= e["resolved_rate"]["ci_low"]
            <= e["resolved_rate"]["value"]
            <= e["resolved_rate"]["ci_high"]
        )
        episodes = pages(client, f"/v1/runs/{run_id}/trajectories", eval_id=e["eval_id"])
        assert len(episodes) == e["expected"] and {t["eval_sample"] for t in episodes} == {0, 1}
        assert all(t["trained_count"] == 0 for t in episodes)
    training = pages(client, f"/v1/runs/{run_id}/trajectories")
    assert training and all(t["eval_id"] is None for t in training)
    assert {t["task_id"] for t in training}.isdisjoint(
        {
            t["task_id"]
            for e in evals
            for t in pages(client, f"/v1/runs/{run_id}/trajectories", eval_id=e["eval_id"])
        }
    )
    shown = crucible("runs", "show", run_id, "--json", env=env)
    assert shown.returncode == 0 and len(json.loads(shown.stdout)["evals"]) == 3
    assert client.post("/v1/evals", json={"run_id": run_id, "version": 99}).status_code == 404
    assert client.post("/v1/evals", json={"run_id": "run-nope"}).status_code == 404
    assert client.post("/v1/evals", json={"run_id": run_id, "samples": -1}).status_code == 422
    assert client.get("/v1/evals/nope").status_code == 404

    # The dashboard shows the finished run in a real browser: its curves drawn, its evaluations,
    # and a transcript one click away.
    page = dom(stack.login_url(f"/runs/{run_id}"))
    assert 'data-drawn="true"' in page
    for chart in ("reward", "resolved", "evals", "loss", "staleness", "throughput"):
        figure = page.split(f'id="chart-{chart}"', 1)[1].split(">", 1)[0]
        assert 'data-points="' in figure and 'data-points="0"' not in figure, (chart, figure)
    assert page.count('class="uplot') >= 6 and "pass@1" in page
    assert page.count("/trajectories/") >= len(training[:20])
    transcript = dom(stack.login_url(f"/trajectories/{training[0]['trajectory_id']}"))
    assert 'class="segment agent"' in transcript and 'class="segment environment"' in transcript
    assert "FAIL_TO_PASS" in transcript and 'id="tool-calls"' in transcript
    assert "imported" in dom(stack.login_url("/"))
