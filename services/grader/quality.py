"""Quality measures of an evaluated change that resolved its task, beyond correctness (Cursor-Bench-like):
does it follow the codebase's practice, or does it only make the tests pass?

    lint_introduced          ruff findings (E, F, W) in the touched Python files, after minus before
    diff_size_ratio          changed lines of the change / changed lines of the reference patch
    files_outside_reference  files the change touches that the reference patch does not
    tests_added              test functions the change adds (in new test modules)
    tool_calls, tokens, wall_s   what the episode spent: calls made, tokens sampled, seconds

ruff runs inside the grading sandbox, on the repository before and after the change; it reads code and
never runs it.
"""

from __future__ import annotations

import re

from crucible.clients.sandbox import SandboxSession
from crucible.contracts.messages import Trajectory
from crucible.contracts.trajectories import arrays
from crucible.lint import RUFF_CHECK
from services.grader.anticheat import BadDiff, added_test_modules, diff_path, parse_diff, touched_paths

LINT_COMMAND = (*RUFF_CHECK, "--exit-zero", "--statistics", "--")
LINT_TIMEOUT_S = 60.0
_STATISTIC = re.compile(r"^(\d+)\t", re.MULTILINE)
_TEST_DEF = re.compile(r"^\s*(?:async\s+)?def test_")


def _files(diff: str) -> list:
    """The diff's files; an unreadable diff has none (the grader refused those before measuring)."""
    try:
        return list(parse_diff(diff))
    except BadDiff:
        return []


def lint_paths(diff: str) -> tuple[list[str], list[str]]:
    """The Python files the diff touches as they exist before it and after it."""
    files = _files(diff)
    before = [
        diff_path(f.source_file) for f in files if not f.is_added_file and f.source_file.endswith(".py")
    ]
    after = [
        diff_path(f.target_file) for f in files if not f.is_removed_file and f.target_file.endswith(".py")
    ]
    return before, after  # type: ignore[return-value]  # neither side is /dev/null here


async def lint_findings(session: SandboxSession, paths: list[str]) -> int | None:
    """ruff's findings in `paths`, or None when ruff could not run."""
    if not paths:
        return 0
    result = await session.run([*LINT_COMMAND, *paths], timeout_s=LINT_TIMEOUT_S)
    if result.exit_code != 0:
        return None
    return sum(int(n) for n in _STATISTIC.findall(result.output))


def change_measures(*, trajectory: Trajectory, reference_patch: str) -> dict[str, float]:
    """Everything but lint, read from the diffs and the trajectory."""
    files, reference = _files(trajectory.final_diff), _files(reference_patch)
    new_tests = set(added_test_modules(trajectory.final_diff)) if files else set()
    touched = set(touched_paths(trajectory.final_diff)) if files else set()
    expected = set(touched_paths(reference_patch)) if reference else set()
    reference_lines = sum(f.added + f.removed for f in reference)
    tests_added = sum(
        1
        for f in files
        if diff_path(f.target_file) in new_tests
        for hunk in f
        for line in hunk
        if line.is_added and _TEST_DEF.match(line.value)
    )
    return {
        "diff_size_ratio": sum(f.added + f.removed for f in files) / reference_lines
        if reference_lines
        else 0.0,
        "files_outside_reference": float(len(touched - expected - new_tests)),
        "tests_added": float(tests_added),
        "tool_calls": float(len(trajectory.tool_calls)),
        "tokens": float(arrays(trajectory).num_sampled),
        "wall_s": max(0.0, trajectory.finished_at - trajectory.started_at),
    }
