"""The grader end to end: a real catalog task, a real sandbox, trajectories on ROLLOUTS, rewards on GRADED."""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid

import msgspec
import pytest
from cli_runner import settings_env
from grading_task import a_task, tool_call, trajectory
from nats.js.api import DeliverPolicy
from prometheus_client import REGISTRY

from crucible.bus import Bus
from crucible.clients.sandbox import SandboxClient
from crucible.contracts import decode, subjects
from crucible.contracts.keys import graded_key
from crucible.contracts.messages import (
    GradedTrajectory,
    RunCreated,
    TaskReply,
)
from crucible.contracts.runconfig import RunConfig
from crucible.db.migrate import upgrade_async
from services.catalog.app import setup as catalog_setup
from services.catalog.settings import Settings as CatalogSettings
from services.grader.app import setup as grader_setup
from services.grader.reward import quality_term

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WRONG_BUT_CLEAN = """\
diff --git a/NOTES.md b/NOTES.md
new file mode 100644
--- /dev/null
+++ b/NOTES.md
@@ -0,0 +1 @@
+Looked around; not sure where the bug is.
"""


NEW_TEST_MODULE = """\
diff --git a/tests/test_extra.py b/tests/test_extra.py
new file mode 100644
--- /dev/null
+++ b/tests/test_extra.py
@@ -0,0 +1,2 @@
+def test_more():
+    assert True
"""


def with_wrong_context(patch: str) -> str:
    """The patch with its first removed line changed: it parses, but no longer applies."""
    lines = patch.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.startswith("-") and not line.startswith("---"))
    lines[first] = "-# a line that is not in the file\n"
    return "".join(lines)


async def count_on(bus: Bus, stream: str, subject: str) -> int:
    info = await bus.js.stream_info(stream, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def dead_letters_of(bus: Bus, run_id: str) -> list[str]:
    """Why the run's trajectories were dead-lettered (other tests' runs share the stream)."""
    letters = await bus.dead_letters(stream=subjects.ROLLOUTS, limit=10_000)
    return [letter.reason for _, letter in letters if letter.subject == subjects.rollouts(run_id)]


async def wait_for(predicate, *, timeout_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.3)


async def graded_messages(bus: Bus, run_id: str) -> list[GradedTrajectory]:
    subject = subjects.graded(run_id)
    count = await count_on(bus, subjects.GRADED, subject)
    sub = await bus.js.subscribe(subject, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    try:
        return [decode((await sub.next_msg(timeout=5)).data, GradedTrajectory) for _ in range(count)]
    finally:
        await sub.unsubscribe()


async def queue_drained(bus: Bus, run_id: str) -> bool:
    return await count_on(bus, subjects.ROLLOUTS, subjects.rollouts(run_id)) == 0


async def test_rewards_for_right_wrong_cheating_and_broken_diffs_each_graded_once(bus, grader):
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    task = await a_task(bus, run_id)
    secret = task.secret
    assert secret is not None
    right = trajectory(
        run_id=run_id,
        task=task,
        diff=secret.reference_patch,
        tool_calls=[tool_call(0, ok=True), tool_call(1, ok=False)],
    )
    wrong = trajectory(run_id=run_id, task=task, diff=WRONG_BUT_CLEAN)
    cheat = trajectory(
        run_id=run_id,
        task=task,
        diff=secret.reference_patch + WRONG_BUT_CLEAN.replace("NOTES.md", "tests/conftest.py"),
    )
    broken = trajectory(run_id=run_id, task=task, diff=with_wrong_context(secret.reference_patch))
    idle = trajectory(run_id=run_id, task=task, diff="", tool_calls=[tool_call(0, ok=True)])
    tested = trajectory(run_id=run_id, task=task, diff=secret.reference_patch + NEW_TEST_MODULE)
    evaluated = msgspec.structs.replace(
        trajectory(run_id=run_id, task=task, diff=secret.reference_patch), eval_id="e1"
    )
    for message in (
        right,
        wrong,
        cheat,
        broken,
        idle,
        tested,
        evaluated,
        right,
    ):  # `right` twice: a redelivery, as far as the grader knows
        await bus.publish(subjects.rollouts(run_id), message)

    await wait_for(
        lambda: queue_drained(bus, run_id), timeout_s=240, what="the grader to take every trajectory"
    )
    graded = {g.trajectory.trajectory_id: g for g in await graded_messages(bus, run_id)}
    assert len(await graded_messages(bus, run_id)) == 7
    assert graded.keys() == {t.trajectory_id for t in (right, wrong, cheat, broken, idle, tested, evaluated)}

    good = graded[right.trajectory_id].reward
    assert good.tests_total > 0 and good.tests_passed == good.tests_total, good
    assert good.resolved and good.total == 1.0 and good.components["base"] == 1.0
    assert (
        good.fail_to_pass == [len(secret.fail_to_pass)] * 2
        and good.pass_to_pass == [len(secret.pass_to_pass)] * 2
    )
    assert all(t.outcome == "passed" for t in good.tests)
    assert good.quality == {}  # measured for evaluations only

    bad = graded[wrong.trajectory_id].reward
    assert bad.tests_total == good.tests_total and bad.tests_passed < bad.tests_total
    assert bad.total == 0.0 and not bad.resolved and bad.fail_to_pass[0] == 0
    assert {t.outcome for t in bad.tests} >= {"failed"}

    nothing = graded[idle.trajectory_id].reward
    assert nothing.total == 0.0 and not nothing.resolved and nothing.tests_total == 0
    assert set(nothing.components.values()) == {0.0} and "unchanged" in nothing.note

    added = graded[tested.trajectory_id].reward
    assert added.resolved and added.total == 1.0, added.note

    # An evaluation's resolved change also gets its quality measured; the reference fix is lint-neutral.
    quality = graded[evaluated.trajectory_id].reward.quality
    assert quality["lint_introduced"] == 0.0 and quality["diff_size_ratio"] == 1.0
    assert quality["files_outside_reference"] == 0.0 and quality["tests_added"] == 0.0

    cheated = graded[cheat.trajectory_id].reward
    assert cheated.total == 0.0 and cheated.tests_total == 0
    assert "tests/conftest.py" in cheated.note

    unapplied = graded[broken.trajectory_id].reward
    assert unapplied.total == 0.0 and "does not apply" in unapplied.note

    assert await grader.redis.exists(graded_key(right.trajectory_id))
    assert graded[right.trajectory_id].trajectory == right


async def test_the_runs_reward_options_are_read_from_its_config(bus, grader):
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    config = RunConfig.model_validate({"reward": {"shaping": 0.5, "tool_error_penalty": 0.2}})
    created = RunCreated(run_id=run_id, name="t", config=config, created_at=0.0)
    await bus.publish(subjects.run_created(run_id), created, msg_id=run_id)
    task = await a_task(bus, run_id)
    assert task.secret is not None
    right = trajectory(
        run_id=run_id, task=task, diff=task.secret.reference_patch,
        tool_calls=[tool_call(0, ok=True), tool_call(1, ok=False)],
    )  # fmt: skip
    await bus.publish(subjects.rollouts(run_id), right)
    await wait_for(lambda: queue_drained(bus, run_id), timeout_s=120, what="the grader")
    [graded] = await graded_messages(bus, run_id)
    # base 1 + shaping 0.5 x 1/2 - tool errors 0.2 x 1/2
    assert graded.reward.total == pytest.approx(1.15)


UNUSED_IMPORT_MODULE = """\
diff --git a/extra_helpers.py b/extra_helpers.py
new file mode 100644
--- /dev/null
+++ b/extra_helpers.py
@@ -0,0 +1 @@
+import os
"""


async def test_a_run_with_quality_terms_pays_a_clean_fix_more_than_a_sloppy_one(bus, grader):
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    weights = {"lint": 0.5, "size": 0.1, "outside": 0.3, "repetition": 0.1}
    config = RunConfig.model_validate({"reward": {"quality": weights}})
    await bus.publish(
        subjects.run_created(run_id), RunCreated(run_id=run_id, name="t", config=config, created_at=0.0),
        msg_id=run_id,
    )  # fmt: skip
    task = await a_task(bus, run_id)
    assert task.secret is not None
    clean = trajectory(run_id=run_id, task=task, diff=task.secret.reference_patch)
    sloppy = trajectory(run_id=run_id, task=task, diff=task.secret.reference_patch + UNUSED_IMPORT_MODULE)
    for message in (clean, sloppy):
        await bus.publish(subjects.rollouts(run_id), message)
    await wait_for(lambda: queue_drained(bus, run_id), timeout_s=120, what="the grader")
    graded = {g.trajectory.trajectory_id: g.reward for g in await graded_messages(bus, run_id)}
    good, bad = graded[clean.trajectory_id], graded[sloppy.trajectory_id]
    assert good.resolved and good.total == 1.0 and good.components["quality"] == 0.0
    assert good.quality["lint_introduced"] == 0.0 and good.quality["repetition"] == 0.0
    assert bad.resolved and bad.quality["lint_introduced"] == 1.0
    assert bad.quality["files_outside_reference"] == 1.0 and bad.quality["diff_size_ratio"] > 1.0
    assert bad.components["quality"] == pytest.approx(quality_term(bad.quality, config.reward.quality))
    assert bad.total == pytest.approx(1.0 + bad.components["quality"]) and bad.total <= 1 - 0.5 / 5 - 0.3 / 3


async def slow_fix(bus: Bus, run_id: str, task: TaskReply) -> str:
    """The reference fix plus a module that sleeps at import: a diff whose tests take a while."""
    assert task.secret is not None
    module = next(
        line.removeprefix("+++ b/")
        for line in task.secret.reference_patch.splitlines()
        if line.startswith("+++ b/")
    )
    async with await SandboxClient(bus).create(
        run_id=run_id, task_id=task.task.task_id, snapshot=task.task.snapshot
    ) as box:
        assert (await box.apply_patch(task.secret.reference_patch)).ok
        appended = await box.run(
            ["bash", "-c", f"printf '\\nimport time\\ntime.sleep(6)\\n' >> {module}"], timeout_s=10
        )
        assert appended.ok, appended
        return await box.diff()


@pytest.mark.parametrize("grader_settings", [{"ack_wait_s": 4.0, "heartbeat_s": 1.0}], indirect=True)
async def test_grader_killed_mid_run_is_picked_up_by_the_next_one(
    bus, sandbox, catalog, grader_settings, start_service, tmp_path
):
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    task = await a_task(bus, run_id)
    slow = trajectory(run_id=run_id, task=task, diff=await slow_fix(bus, run_id, task))
    await bus.publish(subjects.rollouts(run_id), slow)

    log = (tmp_path / "grader.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.grader", env=settings_env(grader_settings), stdout=log, stderr=log
    )
    try:

        async def grading_started() -> bool:
            assert process.returncode is None, (tmp_path / "grader.log").read_text()
            return (REGISTRY.get_sample_value("crucible_sandbox_sessions") or 0) >= 1

        await wait_for(grading_started, timeout_s=60, what="the first grader to open a sandbox")
        await asyncio.sleep(1.0)
        process.send_signal(signal.SIGKILL)
        assert await process.wait() == -signal.SIGKILL
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        log.close()
    assert await count_on(bus, subjects.GRADED, subjects.graded(run_id)) == 0

    async with start_service("grader", grader_settings, grader_setup):
        await wait_for(lambda: queue_drained(bus, run_id), timeout_s=120, what="the second grader to finish")
    graded = await graded_messages(bus, run_id)
    assert [g.trajectory.trajectory_id for g in graded] == [slow.trajectory_id]
    reward = graded[0].reward
    assert reward.tests_total > 0 and reward.tests_passed == reward.tests_total, reward
    assert await dead_letters_of(bus, run_id) == []


@pytest.mark.parametrize("grader_settings", [{"max_deliver": 1}], indirect=True)
async def test_a_trajectory_waits_out_a_catalog_outage_and_is_graded_once_it_is_back(
    bus, sandbox, common_settings, sqlite_url, grader_settings, start_service
):
    """The catalog away is an outage, not the trajectory's fault: the grader holds it (even with
    max_deliver=1) and grades it when the catalog answers again, once, with no dead letter."""
    await upgrade_async(sqlite_url)
    catalog_settings = common_settings(
        CatalogSettings, tasks_per_difficulty=1, difficulties=[1], verify_workers=1
    )
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    async with start_service("catalog", catalog_settings, catalog_setup):
        task = await a_task(bus, run_id)
    assert task.secret is not None
    right = trajectory(run_id=run_id, task=task, diff=task.secret.reference_patch)
    held = f"consume {subjects.ROLLOUTS}"

    def retries() -> float:
        return REGISTRY.get_sample_value("crucible_outage_retries_total", {"work": held}) or 0.0

    before = retries()
    async with start_service("grader", grader_settings, grader_setup):
        await bus.publish(subjects.rollouts(run_id), right)

        async def tried_twice() -> bool:  # two tries without a catalog: past what max_deliver allows
            return retries() - before >= 2

        await wait_for(tried_twice, timeout_s=60, what="the grader to hold the trajectory")
        assert await count_on(bus, subjects.GRADED, subjects.graded(run_id)) == 0
        async with start_service("catalog", catalog_settings, catalog_setup):
            await wait_for(lambda: queue_drained(bus, run_id), timeout_s=120, what="the grader to finish")
    [graded] = await graded_messages(bus, run_id)
    assert graded.trajectory.trajectory_id == right.trajectory_id and graded.reward.resolved
    assert await dead_letters_of(bus, run_id) == []
