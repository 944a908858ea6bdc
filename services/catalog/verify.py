"""Verify a task for real: every FAIL_TO_PASS test fails and every PASS_TO_PASS test passes on the
snapshot (with the hidden tests laid over it), and every one of them passes with the reference patch.

`verdict` is that rule, shared by every kind of task. `verify_task` applies it to a generated task
(Crucible's own templates) with files on disk, pytest in a subprocess and the patch applied by git;
imported and synthesized tasks are verified inside the sandbox (`services.catalog.sandboxed`). Each
test's outcome comes from the report pytest itself writes (`crucible.pytest_report`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from crucible import pytest_report
from crucible.contracts.messages import Expected, TestResult
from crucible.probes import judge
from services.catalog.generator import GeneratedTask


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    task_id: str
    ok: bool
    reason: str = ""
    buggy: dict[str, str] = field(default_factory=dict)
    """Test id -> outcome (passed, failed, error, skipped) on the buggy repository."""
    fixed: dict[str, str] = field(default_factory=dict)
    duration_s: float = 0.0


def verdict(
    *,
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    before: Mapping[str, str],
    after: Mapping[str, str],
) -> str:
    """Why a task's test lists do not hold on these outcomes (test id -> outcome), or "" when they do."""
    if not fail_to_pass:
        return "no FAIL_TO_PASS test"
    listed = [*fail_to_pass, *pass_to_pass]
    for name, outcomes in (("the snapshot", before), ("the reference patch", after)):
        missing = [test for test in listed if test not in outcomes]
        if missing:
            return f"{len(missing)} listed test(s) did not run on {name}, e.g. {missing[0]}"
    if passing := [t for t in fail_to_pass if before[t] == "passed"]:
        return f"FAIL_TO_PASS test passes on the snapshot: {passing[0]}"
    if broken := [t for t in pass_to_pass if before[t] != "passed"]:
        return f"PASS_TO_PASS test {before[broken[0]]} on the snapshot: {broken[0]}"
    if failing := [t for t in listed if after[t] != "passed"]:
        return f"test {after[failing[0]]} with the reference patch: {failing[0]}"
    return ""


class TestRunError(RuntimeError):
    """pytest did not produce a report (timeout, crash, or nothing collected)."""


def write_files(*, root: Path, files: Mapping[str, str | bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def run_tests(
    *, repo: Path, command: Sequence[str], timeout: float, probes: Mapping[str, Expected] | None = None
) -> dict[str, str]:
    """Run a `python -m pytest ...` command in `repo` and return each test's outcome by node id, read
    from the report pytest itself writes (the same plugin the sandbox's run_tests uses), with the probe
    tests judged against their expected outcomes as the grader judges them (`crucible.probes`)."""
    try:
        args = pytest_report.split_command(command)
    except ValueError as exc:
        raise TestRunError(str(exc)) from None
    report = repo.parent / f"{repo.name}-report.jsonl"
    script = pytest_report.install(repo.parent / "plugins")
    argv = [sys.executable, str(script), f"--crucible-report={report}", *args]
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        proc = subprocess.run(
            argv, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise TestRunError(f"tests ran past {timeout}s") from exc
    if not report.exists():
        raise TestRunError(
            f"no test report (exit {proc.returncode}): {proc.stdout[-500:]}{proc.stderr[-500:]}"
        )
    try:
        results = pytest_report.read_report(report.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise TestRunError(str(exc)) from None
    finally:
        report.unlink()
    if not results:
        raise TestRunError(f"no tests ran (exit {proc.returncode}): {proc.stdout[-500:]}")
    try:
        tests = judge([msgspec.convert(r, TestResult) for r in results], probes or {})
    except msgspec.ValidationError as exc:
        raise TestRunError(f"unreadable test report: {exc}") from None
    return {test.nodeid: test.outcome for test in tests}


def apply_patch(
    *, repo: Path, patch: str, timeout: float = 30, what: str = "reference patch", reverse: bool = False
) -> None:
    """`git apply` the patch in `repo` (undo it: `reverse`); the ceiling keeps git from treating a
    parent folder as the repository."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(repo.parent)}
    proc = subprocess.run(
        ["git", "apply", "--whitespace=nowarn", *(["--reverse"] if reverse else []), "-"],
        cwd=repo,
        env=env,
        input=patch,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise TestRunError(f"{what} does not apply: {proc.stderr.strip()}")


def verify_task(task: GeneratedTask, *, timeout: float = 30) -> VerifyResult:
    started = time.monotonic()
    command = list(task.test_command)
    buggy: dict[str, str] = {}
    fixed: dict[str, str] = {}

    def result(reason: str = "") -> VerifyResult:
        return VerifyResult(
            task_id=task.task_id,
            ok=not reason,
            reason=reason,
            buggy=buggy,
            fixed=fixed,
            duration_s=time.monotonic() - started,
        )

    with tempfile.TemporaryDirectory(prefix="crucible-verify-") as tmp:
        repo = Path(tmp) / "repo"
        write_files(root=repo, files={**task.files, **task.hidden_files})
        try:
            buggy = run_tests(repo=repo, command=command, timeout=timeout, probes=task.probes)
            apply_patch(repo=repo, patch=task.reference_patch)
            fixed = run_tests(repo=repo, command=command, timeout=timeout, probes=task.probes)
        except TestRunError as exc:
            return result(str(exc))
    return result(
        verdict(fail_to_pass=task.fail_to_pass, pass_to_pass=task.pass_to_pass, before=buggy, after=fixed)
    )
