"""SWE-bench-format tasks over real local git repositories: imported and verified in the sandbox,
broken instances reported, then sampled from the catalog and graded like generated tasks; and an
unchanged repository scores 0 on every catalog and imported task under every reward option."""

from __future__ import annotations

import json
import uuid

import pytest
import swebench_repos
from cli_runner import crucible_async, settings_env
from reward_options import OPTIONS
from test_grader import graded_messages, queue_drained, trajectory, wait_for

from crucible.clients.sandbox import SandboxClient
from crucible.contracts import endpoints, messages, subjects
from crucible.contracts.messages import ListRequest, SampleRequest, TaskRequest
from crucible.db import make_engine, make_sessionmaker
from services.catalog.importing import import_swebench
from services.catalog.sandboxed import listed_outcomes
from services.grader.reward import compute_reward

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_import_verifies_reports_and_serves(imported, bus):
    report, _good, _ = imported
    assert report.verified == 5, report.rejected
    reasons = report.rejected
    assert set(reasons) == {"line 2", "missing-mirror", "no-such-commit", "no-such-test", "hangs"}
    assert "is not a SWE-bench instance" in reasons["line 2"]
    assert "no mirror of acme/nothere" in reasons["missing-mirror"]
    assert "does not exist in the mirror" in reasons["no-such-commit"]
    assert "did not run on the snapshot, e.g. tests/test_clamp.py::test_not_there" in reasons["no-such-test"]
    assert "ran past 10s" in reasons["hangs"]
    # Split by repository: one of the two is held out.
    assert sorted(report.splits.values()) in ([2, 3], [3, 2]) and set(report.splits) == {"train", "test"}

    sample = SampleRequest(run_id="r", taskset="imported", count=4)
    train = await bus.request(endpoints.CATALOG_SAMPLE, sample)
    held_out = await bus.request(endpoints.CATALOG_LIST, ListRequest(taskset="imported", split="test"))
    assert {t.split for t in train.tasks} == {"train"} and {t.split for t in held_out.tasks} == {"test"}
    repos = {t.task_id.split("-")[1] for t in held_out.tasks} & {t.task_id.split("-")[1] for t in train.tasks}
    assert not repos, "a repository is in both splits"
    hidden = {t.task_id for t in held_out.tasks} | {t.task_id for t in train.tasks}
    assert not {f"imported-{i}" for i in ("hangs", "no-such-test")} & hidden
    await unchanged_repository_scores_zero_on_every_task_under_every_option(bus)


async def test_imported_tasks_grade_like_generated_ones(imported, bus, grader):
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    listed = await bus.request(endpoints.CATALOG_LIST, ListRequest(taskset="imported", split="train"))
    reply = await bus.request(endpoints.CATALOG_SECRET, TaskRequest(task_id=listed.tasks[0].task_id))
    assert reply.secret is not None
    fixed = trajectory(run_id=run_id, task=reply, diff=reply.secret.reference_patch)
    idle = trajectory(run_id=run_id, task=reply, diff="")
    for message in (fixed, idle):
        await bus.publish(subjects.rollouts(run_id), message)
    await wait_for(lambda: queue_drained(bus, run_id), timeout_s=120, what="the grader")
    graded = {g.trajectory.trajectory_id: g.reward for g in await graded_messages(bus, run_id)}
    assert graded[fixed.trajectory_id].resolved and graded[fixed.trajectory_id].total == 1.0
    assert graded[idle.trajectory_id].total == 0.0


async def test_swe_smith_sets_and_empty_test_patches_import_verify_and_grade(
    tmp_path, bus, store, catalog, sandbox, grader
):
    """A SWE-smith-style set (bugs on branches, the repository's own tests catch them, no test_patch)
    and the same bug as SWE-bench-shaped instances with an empty test_patch, lists encoded either way;
    the verification throws out a bug the listed test does not catch. Each imported task's reference
    scores 1 through the grader and an unchanged repository 0."""
    mirrors, smith, bugs = swebench_repos.build_smith(tmp_path)
    harmless = {
        **smith[0], "instance_id": "harmless", "base_commit": bugs["area"][0],
        "FAIL_TO_PASS": ["tests/test_rect.py::test_is_square"], "PASS_TO_PASS": [],
    }  # fmt: skip
    instances = [*smith, *swebench_repos.dataset_variants(smith, bugs), harmless]
    engine = make_engine(catalog.settings.database_url)
    try:
        report = await import_swebench(
            text=swebench_repos.jsonl(instances), repos=mirrors, taskset="smith", split="train",
            scratch=tmp_path / "scratch", store=store, sessionmaker=make_sessionmaker(engine),
            sandboxes=SandboxClient(bus), timeout_s=30,
        )  # fmt: skip
    finally:
        await engine.dispose()
    assert report.verified == 4, report.rejected
    assert report.rejected == {
        "harmless": "FAIL_TO_PASS test passes on the snapshot: tests/test_rect.py::test_is_square"
    }
    listed = await bus.request(endpoints.CATALOG_LIST, ListRequest(taskset="smith", split="train"))
    assert len(listed.tasks) == 4 and all("HINT" not in t.statement for t in listed.tasks)
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    expected = {}
    for spec in listed.tasks:
        reply = await bus.request(endpoints.CATALOG_SECRET, TaskRequest(task_id=spec.task_id))
        assert reply.secret is not None
        for diff, total in ((reply.secret.reference_patch, 1.0), ("", 0.0)):
            message = trajectory(run_id=run_id, task=reply, diff=diff)
            expected[message.trajectory_id] = (spec.task_id, total)
            await bus.publish(subjects.rollouts(run_id), message)
    await wait_for(lambda: queue_drained(bus, run_id), timeout_s=120, what="the grader")
    graded = {g.trajectory.trajectory_id: g.reward.total for g in await graded_messages(bus, run_id)}
    assert {key: (task, graded[key]) for key, (task, _) in expected.items()} == expected


async def unchanged_repository_scores_zero_on_every_task_under_every_option(bus) -> None:
    tasks = []
    for taskset in ("imported", "pybugs"):
        for split in ("train", "test"):
            try:
                listed = await bus.request(endpoints.CATALOG_LIST, ListRequest(taskset=taskset, split=split))
            except Exception:  # the small generated set has no test split
                continue
            tasks += listed.tasks
    assert len(tasks) == 6
    client = SandboxClient(bus)
    for spec in tasks:
        reply = await bus.request(endpoints.CATALOG_SECRET, TaskRequest(task_id=spec.task_id))
        secret = reply.secret
        assert secret is not None
        async with await client.create(run_id="t", task_id=spec.task_id, snapshot=spec.snapshot) as session:
            assert (await session.overlay(secret.hidden_tests)).ok
            outcomes = await listed_outcomes(
                session, test_command=secret.test_command, timeout_s=60, probes=secret.probes
            )
        tests = [messages.TestResult(nodeid=k, outcome=v) for k, v in outcomes.items()]
        for options in OPTIONS:
            lists = {
                "fail_to_pass": secret.fail_to_pass,
                "pass_to_pass": secret.pass_to_pass,
                "options": options,
            }
            assert compute_reward(tests=tests, changed=False, **lists).total == 0.0
            # Even counted as a change, the snapshot's own outcomes earn nothing but shaping.
            assert compute_reward(tests=tests, changed=True, **lists).components["base"] == 0.0, spec.task_id


async def test_the_import_command_prints_one_json_object(tmp_path, catalog, sandbox):
    mirrors, good = swebench_repos.build(tmp_path)
    path = tmp_path / "instances.jsonl"
    path.write_text(
        swebench_repos.jsonl([*good[:2], {**good[0], "instance_id": "x", "repo": "acme/nothere"}])
    )
    code, out, err = await crucible_async(
        "tasks", "import", str(path), "--repos", str(mirrors), "--taskset", "cli-set", "--json",
        env=settings_env(catalog.settings),
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads(out)
    assert summary["taskset"] == "cli-set" and summary["verified"] == 2 and summary["rejected"] == 1
    assert "no mirror" in summary["reasons"]["x"]
