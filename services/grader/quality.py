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

import posixpath
import re

from unidiff import PatchSet

from crucible.clients.sandbox import SandboxSession
from crucible.contracts.messages import Trajectory
from crucible.contracts.packing import unpack
from services.grader.anticheat import added_test_modules

LINT_COMMAND = ("python", "-m", "ruff", "check", "--no-cache", "--isolated", "--exit-zero", "--statistics",
                "--select", "E,F,W", "--")  # fmt: skip
LINT_TIMEOUT_S = 60.0
_STATISTIC = re.compile(r"^(\d+)\t", re.MULTILINE)
_TEST_DEF = re.compile(r"^\s*(?:async\s+)?def test_")


def _patch(diff: str) -> PatchSet:
    """The diff's files; an empty or unreadable diff has none (the grader refused those before)."""
    try:
        return PatchSet(diff) if diff.strip() else PatchSet("")
    except Exception:  # noqa: BLE001 - unidiff raises several types
        return PatchSet("")


def _path(name: str) -> str:
    return posixpath.normpath(name.split("/", 1)[-1])


def lint_paths(diff: str) -> tuple[list[str], list[str]]:
    """The Python files the diff touches as they exist before it and after it."""
    files = list(_patch(diff))
    before = [_path(f.source_file) for f in files if not f.is_added_file and f.source_file.endswith(".py")]
    after = [_path(f.target_file) for f in files if not f.is_removed_file and f.target_file.endswith(".py")]
    return before, after


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
    files = list(_patch(trajectory.final_diff))
    reference = list(_patch(reference_patch))
    new_tests = set(added_test_modules(trajectory.final_diff)) if files else set()
    touched = {_path(name) for f in files for name in (f.source_file, f.target_file) if name != "/dev/null"}
    expected = {_path(name) for f in reference for name in (f.source_file, f.target_file) if name != "/dev/null"}
    reference_lines = sum(f.added + f.removed for f in reference)
    tests_added = sum(
        1
        for f in files
        if _path(f.target_file) in new_tests
        for hunk in f
        for line in hunk
        if line.is_added and _TEST_DEF.match(line.value)
    )
    return {
        "diff_size_ratio": sum(f.added + f.removed for f in files) / reference_lines if reference_lines else 0.0,
        "files_outside_reference": float(len(touched - expected - new_tests)),
        "tests_added": float(tests_added),
        "tool_calls": float(len(trajectory.tool_calls)),
        "tokens": float(sum(unpack("u8", trajectory.loss_mask))),
        "wall_s": max(0.0, trajectory.finished_at - trajectory.started_at),
    }
