"""Verify a generated task for real: files on disk, pytest in a subprocess, the patch applied by git.

Each test's outcome comes from the report pytest itself writes (`crucible.pytest_report`). A task is
served only if, on the buggy repository, at least one hidden test fails, at least one
passes and every visible test passes; and, with the reference patch applied, every test passes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from crucible import pytest_report
from services.catalog.generator import HIDDEN_TESTS, GeneratedTask


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    task_id: str
    ok: bool
    reason: str = ""
    buggy: dict[str, str] = field(default_factory=dict)
    """Test id -> outcome (passed, failed, error, skipped) on the buggy repository."""
    fixed: dict[str, str] = field(default_factory=dict)
    duration_s: float = 0.0


_TEST_DEF = re.compile(r"^def test_", re.MULTILINE)


class TestRunError(RuntimeError):
    """pytest did not produce a report (timeout, crash, or nothing collected)."""


def write_files(*, root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def run_tests(*, repo: Path, command: Sequence[str], timeout: float) -> dict[str, str]:
    """Run a `python -m pytest ...` command in `repo` and return each test's outcome by node id, read
    from the report pytest itself writes (the same plugin the sandbox's run_tests uses)."""
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
    return {str(r["nodeid"]): str(r["outcome"]) for r in results}


def apply_patch(*, repo: Path, patch: str, timeout: float = 30) -> None:
    """`git apply` the patch in `repo`; the ceiling keeps git from treating a parent folder as the repository."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(repo.parent)}
    proc = subprocess.run(
        ["git", "apply", "--whitespace=nowarn", "-"],
        cwd=repo,
        env=env,
        input=patch,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise TestRunError(f"reference patch does not apply: {proc.stderr.strip()}")


def verify_task(task: GeneratedTask, *, timeout: float = 30) -> VerifyResult:
    started = time.monotonic()
    visible = sorted(p for p in task.files if p.startswith("tests/test_") and p.endswith(".py"))
    command = [*task.test_command, *visible]
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
            buggy = run_tests(repo=repo, command=command, timeout=timeout)
            apply_patch(repo=repo, patch=task.reference_patch)
            fixed = run_tests(repo=repo, command=command, timeout=timeout)
        except TestRunError as exc:
            return result(str(exc))
    hidden = {k: v for k, v in buggy.items() if k.split("::")[0] == HIDDEN_TESTS}
    expected = sum(
        len(_TEST_DEF.findall(text))
        for path, text in {**task.files, **task.hidden_files}.items()
        if path.startswith("tests/")
    )
    if len(fixed) != expected or len(buggy) != expected:
        return result(
            f"expected {expected} tests, ran {len(buggy)} on the bug and {len(fixed)} with the patch"
        )
    if not any(v != "passed" for v in hidden.values()):
        return result("no hidden test fails on the buggy repository")
    if not any(v == "passed" for v in hidden.values()):
        return result("every hidden test fails on the buggy repository (no partial credit)")
    if any(v != "passed" for k, v in buggy.items() if k not in hidden):
        return result("a visible test fails on the buggy repository")
    if any(v != "passed" for v in fixed.values()):
        return result("a test fails with the reference patch applied")
    return result()
