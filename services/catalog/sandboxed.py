"""Verify a task inside the sandbox service, the way the grader will run it.

For tasks whose code Crucible did not write (imported, synthesized): the listed tests run (`run_tests`,
results from pytest itself) in a session of the snapshot with the hidden tests laid over it, and in one
where the reference patch was applied first, as the grader applies a diff. `verify.verdict` decides.
"""

from __future__ import annotations

from collections.abc import Mapping

from crucible import pytest_report
from crucible.clients.sandbox import SandboxClient, SandboxSession
from crucible.contracts.messages import Expected, ObjectRef
from crucible.probes import judge
from services.catalog.verify import verdict


class SandboxVerifyError(RuntimeError):
    """The tests gave no outcomes (timeout, collection crash); the message says why."""


async def listed_outcomes(
    session: SandboxSession,
    *,
    test_command: list[str],
    timeout_s: float,
    probes: Mapping[str, Expected] | None = None,
) -> dict[str, str]:
    """Run the task's test command in the session: test id -> outcome, probe tests judged as the grader
    judges them (`crucible.probes`)."""
    try:
        args = pytest_report.split_command(test_command)
    except ValueError as exc:
        raise SandboxVerifyError(str(exc)) from None
    run = await session.tool("run_tests", pytest_args=args, timeout_s=timeout_s)
    if run.timed_out:
        raise SandboxVerifyError(f"tests ran past {timeout_s:.0f}s")
    if not run.tests:
        raise SandboxVerifyError(f"no test results ({run.error or 'no tests ran'}): {run.output[-300:]}")
    return {test.nodeid: test.outcome for test in judge(run.tests, probes or {})}


async def verify_in_sandbox(
    client: SandboxClient,
    *,
    task_id: str,
    snapshot: ObjectRef,
    hidden: ObjectRef,
    reference_patch: str,
    test_command: list[str],
    fail_to_pass: list[str],
    pass_to_pass: list[str],
    timeout_s: float,
) -> str:
    """Why the task fails verification, or "" when it holds. Two sessions, in the grader's order: the
    snapshot with the hidden tests; the snapshot with the reference patch, then the hidden tests."""
    outcomes = []
    for patch in ("", reference_patch):
        async with await client.create(
            run_id="catalog-verify", task_id=task_id, snapshot=snapshot
        ) as session:
            if patch:
                applied = await session.apply_patch(patch)
                if not applied.ok:
                    return f"reference patch does not apply: {applied.error or ''} {applied.output}".strip()[
                        :500
                    ]
            overlay = await session.overlay(hidden)
            if not overlay.ok:
                return f"hidden tests do not unpack: {overlay.error}"
            try:
                outcomes.append(
                    await listed_outcomes(session, test_command=test_command, timeout_s=timeout_s)
                )
            except SandboxVerifyError as exc:
                return f"{exc} ({'with the reference patch' if patch else 'on the snapshot'})"
    before, after = outcomes
    return verdict(fail_to_pass=fail_to_pass, pass_to_pass=pass_to_pass, before=before, after=after)
