"""Quality measures of an evaluated change that resolved its task, beyond correctness (Cursor-Bench-like):
does it follow the codebase's practice, or does it only make the tests pass?

    lint_introduced          ruff findings (E, F, W) in the touched Python files, after minus before
    diff_size_ratio          changed lines of the change / changed lines of the reference patch
    files_outside_reference  files the change touches that the reference patch does not
    tests_added              test functions the change adds (in new test modules)
    repetition               share of the lines the change adds (to non-test Python files) that repeat,
                             in shape, 3 or more lines the repository has elsewhere (`REPETITION`)
    tool_calls, tokens, wall_s   what the episode spent: calls made, tokens sampled, seconds

ruff and the repetition script run inside the grading sandbox on the repository (ruff before and after
the change, the script after it); both read code and never run it. With `reward.quality` set, the
measures also weigh into a training run's reward (`services.grader.reward.quality_term`).
"""

from __future__ import annotations

import json
import re

from crucible import pytest_report
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


REPETITION = r"""
import io, json, keyword, os, sys, tokenize
added = {path: set(rows) for path, rows in json.loads(sys.argv[1]).items()}
WINDOW, MIN_TOKENS, MAX_FILES, MAX_BYTES = 3, 12, 5000, 1 << 20
SKIP = {"__pycache__", "node_modules", "site-packages"}
LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
          tokenize.ENDMARKER}

def shapes(text):
    rows = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in LAYOUT:
            continue
        if tok.type == tokenize.NAME and not keyword.iskeyword(tok.string):
            word = "N"
        elif tok.type in (tokenize.NUMBER, tokenize.STRING):
            word = "L"
        else:
            word = tok.string
        rows.setdefault(tok.start[0], []).append(word)
    return sorted(rows.items())

elsewhere, mine, lines_added, files = set(), [], 0, 0
for folder, dirs, names in os.walk("."):
    dirs[:] = sorted(d for d in dirs if d not in SKIP and not d.startswith("."))
    for name in sorted(names):
        path = os.path.relpath(os.path.join(folder, name))
        if not name.endswith(".py") or files >= MAX_FILES or os.path.islink(path) or not os.path.isfile(path):
            continue
        files += 1
        try:
            with open(path, encoding="utf-8") as f:
                rows = shapes(f.read(MAX_BYTES + 1)) if os.fstat(f.fileno()).st_size <= MAX_BYTES else []
        except (OSError, UnicodeDecodeError, SyntaxError, tokenize.TokenError):
            continue
        new = added.get(path, set())
        lines_added += sum(1 for row, _ in rows if row in new)
        for i in range(len(rows) - WINDOW + 1):
            window = rows[i : i + WINDOW]
            if sum(len(words) for _, words in window) < MIN_TOKENS:
                continue
            key, where = tuple(" ".join(words) for _, words in window), {row for row, _ in window}
            if where <= new:
                mine.append((key, {(path, row) for row in where}))
            elif not where & new:
                elsewhere.add(key)
repeated = set().union(*(where for key, where in mine if key in elsewhere))
print(json.dumps({"added": lines_added, "repeated": len(repeated)}))
"""
"""Reads every Python file of the workspace (at most 5,000, of 1 MiB each) as token shapes per line: a
name is N, a number or string L, keywords and operators themselves; comments and layout are dropped.
A window of 3 consecutive non-blank lines (12 tokens or more) that the change added and whose shape
occurs in a window with no added line counts its lines as repeated."""
REPETITION_TIMEOUT_S = 60.0


async def repetition(session: SandboxSession, diff: str) -> float | None:
    """The `repetition` measure of a change applied in `session`, or None when the script failed."""
    added: dict[str, list[int]] = {}
    for f in _files(diff):
        path = diff_path(f.target_file)
        if path is None or not path.endswith(".py") or pytest_report.is_test_path(path):
            continue
        rows = [line.target_line_no for hunk in f for line in hunk if line.is_added]
        if rows:
            added[path] = rows
    if not added:
        return 0.0
    argv = ["python", "-I", "-c", REPETITION, json.dumps(added)]
    result = await session.run(argv, timeout_s=REPETITION_TIMEOUT_S)
    try:
        counts = json.loads(result.output.strip().splitlines()[-1])
        return counts["repeated"] / counts["added"] if counts["added"] else 0.0
    except (ValueError, IndexError, KeyError, TypeError):
        return None


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
