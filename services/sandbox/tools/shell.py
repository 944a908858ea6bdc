"""Commands in the session's sandbox: run_terminal_cmd (foreground with a timeout and an output cap
keeping head and tail, or in the background), background_job (its output so far, or kill it),
run_tests (pytest node ids in, one structured result per test out) and read_lints (ruff's findings in
the files named or changed)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import msgspec
from unidiff.patch import PatchSet

from crucible import pytest_report
from crucible.contracts.messages import TestResult
from crucible.contracts.sandbox import GuardFinding, GuardSpec, ToolResult
from crucible.lint import RUFF_CHECK
from services.sandbox.isolation.bwrap import PLUGIN_DIR, Bind
from services.sandbox.session import Session
from services.sandbox.tools.registry import Args, ToolFailure, tool

Seconds = Annotated[float, msgspec.Meta(gt=0)]
REPORT_DIR = "/crucible/report"  # a fresh folder per run, bound only for that run
REPORT = "results.jsonl"
GUARD = "guard.json"
PYTEST = ["python", f"{PLUGIN_DIR}/{pytest_report.SCRIPT}", "-p", "no:cacheprovider"]
REPORT_CAP_BYTES = 8 * 1024 * 1024
FAILED = ("failed", "error")


class RunArgs(Args):
    command: str
    timeout_s: Seconds | None = None
    is_background: bool = False


@tool(
    name="run_terminal_cmd",
    args=RunArgs,
    aliases=("run", "bash", "shell", "execute_bash"),
    arg_aliases={"cmd": "command", "timeout": "timeout_s", "background": "is_background"},
    description="Run a bash command in the repository (loopback network only). Output is capped, head "
    "and tail kept. is_background=true starts it in the background and answers a job id (see "
    "background_job); on a replica run as root, a server it starts answers the session's later "
    "commands on 127.0.0.1.",
)
async def run_terminal_cmd(session: Session, args: RunArgs) -> ToolResult:
    if not args.command.strip():
        raise ToolFailure("command must not be empty")
    if args.is_background:
        job_id = await session.start_job(args.command)
        return ToolResult(ok=True, output=f"started in the background as job {job_id}")
    s = session.settings
    timeout = min(args.timeout_s or s.run_timeout_s, s.max_run_timeout_s)
    return await session.sandboxed(["bash", "-lc", args.command], timeout_s=timeout)


class JobArgs(Args):
    job_id: str
    kill: bool = False


@tool(
    name="background_job",
    args=JobArgs,
    aliases=("job_status", "check_background"),
    description="A background job's state and output so far (head and tail); kill=true stops it.",
)
async def background_job(session: Session, args: JobArgs) -> ToolResult:
    job = session.jobs.get(args.job_id)
    if job is None:
        known = ", ".join(session.jobs) or "none"
        raise ToolFailure(f"no background job {args.job_id!r} (jobs: {known})")
    if args.kill:
        await job.kill()
    return job.result()


class RunTestsArgs(Args):
    node_ids: list[str] = msgspec.field(default_factory=list)
    """pytest node ids (tests/test_x.py::test_y) or paths; none: pytest's own collection."""
    pytest_args: list[str] = msgspec.field(default_factory=list)
    timeout_s: Seconds | None = None
    guard: GuardSpec | None = None
    """Run under the grading guard (the grader's runs): see `crucible.pytest_report`."""


def _parse_report(text: str) -> list[TestResult]:
    try:
        return [msgspec.convert(result, TestResult) for result in pytest_report.read_report(text)]
    except (ValueError, msgspec.ValidationError) as exc:
        raise ToolFailure(f"unreadable test report: {exc}") from None


def _parse_guard(text: str) -> list[GuardFinding]:
    """The guard's findings; a line that is not one (the code under test can write to the log, but only
    to its own harm) is a finding too."""
    found = []
    for line in text.splitlines():
        try:
            found.append(msgspec.json.decode(line, type=GuardFinding))
        except msgspec.DecodeError:
            found.append(GuardFinding(rule="report-paths", path="", line=0, detail=f"forged: {line[:100]!r}"))
    return found


@tool(
    name="run_tests",
    args=RunTestsArgs,
    aliases=("pytest",),
    arg_aliases={"tests": "node_ids", "test_ids": "node_ids", "args": "pytest_args"},
    description="Run pytest on the given node ids; answers one result per test (passed, failed, error, "
    "skipped) from pytest itself, plus the console output.",
)
async def run_tests(session: Session, args: RunTestsArgs) -> ToolResult:
    for node in [*args.node_ids, *args.pytest_args]:
        if not isinstance(node, str) or not node or "\x00" in node:
            raise ToolFailure(f"not a usable pytest argument: {node!r}")
    for node in args.node_ids:
        if node.startswith("-"):
            raise ToolFailure(f"{node!r} is an option, not a node id (put options in pytest_args)")
    s = session.settings
    timeout = min(args.timeout_s or s.run_timeout_s, s.max_run_timeout_s)
    # On the session's own tmpfs (where there is one), so what pytest's process writes there counts
    # against the session's disk quota, not the host's disk.
    report_dir = Path(tempfile.mkdtemp(prefix="report-", dir=session.workspace.root))
    try:
        if session.sandbox.owner is not None:
            os.chown(report_dir, *session.sandbox.owner)
        guard = []
        if args.guard is not None:
            (report_dir / GUARD).write_bytes(msgspec.json.encode(args.guard))
            guard = [f"--crucible-guard={REPORT_DIR}/{GUARD}"]
        report = f"--crucible-report={REPORT_DIR}/{REPORT}"
        argv = [*PYTEST, report, *guard, *args.pytest_args, "--", *args.node_ids]
        result = await session.sandboxed(
            argv,
            timeout_s=timeout,
            binds=[Bind(source=report_dir, dest=REPORT_DIR, writable=True)],
        )
        written = report_dir / REPORT
        if written.is_file() and not written.is_symlink() and written.stat().st_size <= REPORT_CAP_BYTES:
            result.tests = _parse_report(written.read_text(errors="replace"))
        logged = report_dir / pytest_report.GUARD_LOG
        if (
            guard
            and logged.is_file()
            and not logged.is_symlink()
            and logged.stat().st_size <= REPORT_CAP_BYTES
        ):
            result.guard = _parse_guard(logged.read_text(errors="replace"))
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
    no_failure = result.tests and not any(t.outcome in FAILED for t in result.tests)
    if no_failure and not result.timed_out and result.exit_code != 0:
        # The code under test runs in pytest's process and can rewrite the report (from an atexit hook, a
        # thread...); pytest's exit status says something failed, so the report is not believed.
        result.tests = None
        result.ok = False
        result.error = f"pytest exited with code {result.exit_code} but its report shows no failure"
    elif result.tests is None and not result.timed_out:
        result.ok = False
        result.error = f"pytest wrote no report ({result.error or 'exit code 0'})"
    elif result.tests is not None:
        failed = [t for t in result.tests if t.outcome in FAILED]
        result.ok = not failed and not result.timed_out and bool(result.tests)
        passed = sum(t.outcome == "passed" for t in result.tests)
        result.error = (
            None if result.ok else result.error or f"{len(failed)} of {len(result.tests)} tests failed"
        )
        result.output = (
            f"{passed} passed, {len(failed)} failed or errored, {len(result.tests)} in all\n{result.output}"
        )
    return result


class ReadLintsArgs(Args):
    paths: list[str] = msgspec.field(default_factory=list)
    """Python files or folders of the repository; none: the Python files the session changed."""


@tool(
    name="read_lints",
    args=ReadLintsArgs,
    aliases=("lint", "lints"),
    arg_aliases={"files": "paths", "file_paths": "paths", "target_files": "paths"},
    description="Linter findings (ruff: errors, undefined names, unused imports, style warnings) in the "
    "given Python files or folders, one per line as path:line:column: code message; no paths: the "
    "Python files you changed.",
)
async def read_lints(session: Session, args: ReadLintsArgs) -> ToolResult:
    for path in args.paths:
        if not isinstance(path, str) or not path or "\x00" in path or path.startswith("-"):
            raise ToolFailure(f"not a usable path: {path!r}")
    paths = args.paths or [
        f.path for f in PatchSet(await session.diff()) if f.path.endswith(".py") and not f.is_removed_file
    ]
    if not paths:
        return ToolResult(ok=True, output="no changed Python file to lint")
    argv = [*RUFF_CHECK, "--output-format=concise", "--exit-zero", "--", *paths]
    result = await session.sandboxed(argv, timeout_s=session.settings.run_timeout_s)
    result.ok = result.ok and result.exit_code == 0
    return result
