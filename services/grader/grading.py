"""Grading one trajectory: rebuild its final workspace in a fresh sandbox and run the hidden tests.

The per-test outcomes come from the sandbox's `run_tests` tool, which reads them from pytest itself,
never from the console the code under test can print into.

A trajectory that cheats or whose code fails scores 0 (see `reward`). A failure of Crucible's own
infrastructure (catalog or sandbox unreachable or refusing, a bus timeout, a task whose hidden tests do
not unpack) raises instead, so the message is redelivered and graded later rather than scored 0.
"""

from __future__ import annotations

import structlog

from crucible import pytest_report
from crucible.bus import Bus, BusError
from crucible.clients.sandbox import SandboxClient, SandboxSession
from crucible.contracts import subjects
from crucible.contracts.messages import Reward, TaskReply, TaskRequest, TaskSecret, Trajectory
from services.grader.anticheat import BadDiff, protected_paths
from services.grader.reward import compute_reward, zero_reward
from services.grader.settings import Settings

log = structlog.get_logger("crucible.grader")
NOTE_CHARS = 500


class GradingInfraError(RuntimeError):
    """Crucible, not the trajectory, failed; grade it again later."""


async def grade(*, bus: Bus, trajectory: Trajectory, settings: Settings) -> Reward:
    request = TaskRequest(task_id=trajectory.task_id, include_secret=True)
    task = await bus.request(subjects.CATALOG_GET, request, TaskReply, timeout=settings.catalog_timeout_s)
    if task.secret is None or not task.secret.test_command:
        raise GradingInfraError(f"catalog sent task {trajectory.task_id} without its secret or test command")
    try:
        protected = protected_paths(trajectory.final_diff)
    except BadDiff as exc:
        return zero_reward(note=f"diff does not parse: {exc}"[:NOTE_CHARS])
    if protected:
        return zero_reward(
            note=f"diff touches test files or pytest configuration: {', '.join(protected)}"[:NOTE_CHARS]
        )
    client = SandboxClient(
        bus, create_timeout_s=settings.sandbox_timeout_s, call_timeout_s=settings.sandbox_timeout_s
    )
    session = await client.create(
        run_id=trajectory.run_id,
        task_id=trajectory.task_id,
        snapshot=task.task.snapshot,
        ttl_s=settings.sandbox_ttl_s,
    )
    try:
        return await run_hidden_tests(
            session=session, trajectory=trajectory, secret=task.secret, settings=settings
        )
    finally:
        try:
            await session.destroy()
        except BusError as exc:  # the session's TTL reclaims it
            log.warning("could not destroy grading sandbox", session=session.session_id, error=str(exc))


async def run_hidden_tests(
    *, session: SandboxSession, trajectory: Trajectory, secret: TaskSecret, settings: Settings
) -> Reward:
    applied = await session.apply_patch(trajectory.final_diff)
    if not applied.ok:
        return zero_reward(
            note=f"diff does not apply: {applied.error or ''} {applied.output}".strip()[:NOTE_CHARS]
        )
    overlay = await session.overlay(secret.hidden_tests)
    if not overlay.ok:
        raise GradingInfraError(f"hidden tests of {secret.task_id} do not unpack: {overlay.error}")
    try:
        args = pytest_report.split_command(secret.test_command)
    except ValueError as exc:
        raise GradingInfraError(f"task {secret.task_id}: {exc}") from None
    run = await session.tool("run_tests", pytest_args=args, timeout_s=settings.test_timeout_s)
    if run.timed_out:
        return zero_reward(note=f"hidden tests ran past {settings.test_timeout_s:.0f}s")
    if not run.tests:
        return zero_reward(
            note=f"no test results ({run.error or 'no tests ran'}): {run.output[-300:]}"[:NOTE_CHARS]
        )
    return compute_reward(
        tests=run.tests, tool_calls=trajectory.tool_calls, shaping_weight=settings.shaping_weight
    )
