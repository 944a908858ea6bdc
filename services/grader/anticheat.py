"""Anti-cheat: a diff may change the code under test, never the tests or how pytest runs them. It may
add a new test module (a test_*.py or *_test.py file that did not exist): grading runs the task's own
listed tests only, so a new module is never collected, and adding tests is good practice. It may not
add a top-level module or package named like one of the standard library's: the workspace comes first
on the tests' import path, so it would be imported in the library's place (a `fractions.py` whose
`Fraction` is equal to anything).

Paths are read with a unified-diff parser and taken as `git apply` takes them (the first path
component, `a/` or `b/`, stripped). Both sides of a rename or copy count: moving a test file away is
touching it.
"""

from __future__ import annotations

import ast
import fnmatch
import posixpath
import sys

from unidiff.errors import UnidiffParseError
from unidiff.patch import PatchSet

from crucible.pytest_report import TEST_FILE_PATTERNS, is_test_path

PYTEST_CONFIG = frozenset({"pytest.ini", ".pytest.ini", "setup.cfg", "pyproject.toml", "tox.ini"})
STARTUP_HOOKS = frozenset({"sitecustomize.py", "usercustomize.py"})
"""Run by the interpreter before any test; as good as a conftest.py."""


class BadDiff(ValueError):
    """The diff cannot be read as a unified diff."""


def _unquote(path: str) -> str:
    """git writes unusual names C-quoted: "b/t\\303\\251st.py"."""
    if len(path) >= 2 and path[0] == path[-1] == '"':
        try:
            raw = ast.literal_eval("b" + path)
        except (ValueError, SyntaxError) as exc:
            raise BadDiff(f"unreadable quoted path {path}") from exc
        return raw.decode("utf-8", errors="replace")
    return path


def diff_path(path: str) -> str | None:
    """A diff header's path as `git apply` takes it (None for /dev/null)."""
    path = _unquote(path.strip())
    if path == "/dev/null":
        return None
    parts = path.split("/", 1)
    return posixpath.normpath(parts[-1])


def parse_diff(diff: str) -> PatchSet | list:
    """The diff's files ([] for an empty diff); BadDiff if it does not parse."""
    if not diff.strip():
        return []
    try:
        patch = PatchSet(diff)
    except UnidiffParseError as exc:
        raise BadDiff(str(exc)) from exc
    if not len(patch):
        raise BadDiff("no file changes found in a non-empty diff")
    return patch


def touched_paths(diff: str) -> list[str]:
    """Every path, before and after, that applying `diff` would create, change, move or delete."""
    paths: set[str] = set()
    for file in parse_diff(diff):
        for name in (file.source_file, file.target_file):
            if name and (path := diff_path(name)) is not None:
                paths.add(path)
    return sorted(paths)


def added_test_modules(diff: str) -> list[str]:
    """The new test modules `diff` creates (allowed; see the module's docstring)."""
    return sorted(
        path
        for file in parse_diff(diff)
        if file.is_added_file
        and (path := diff_path(file.target_file)) is not None
        and _is_test_module(path.rsplit("/", 1)[-1])
    )


def added_lines(diff: str) -> dict[str, list[int]]:
    """The line numbers, after the change, of every line `diff` adds, by path (a new file: all of it)."""
    added = {}
    for file in parse_diff(diff):
        path = diff_path(file.target_file) if file.target_file else None
        lines = [line.target_line_no for hunk in file for line in hunk if line.is_added]
        if path is not None and lines:
            added[path] = lines
    return added


def _is_test_module(name: str) -> bool:
    return name != "conftest.py" and any(fnmatch.fnmatchcase(name, p) for p in TEST_FILE_PATTERNS)


def is_protected(path: str) -> bool:
    """True for test files, test folders, pytest configuration, interpreter start-up hooks and
    bytecode (a cached module is loaded in place of its source)."""
    name = path.split("/")[-1]
    startup = name in STARTUP_HOOKS or name.endswith(".pth")
    bytecode = name.endswith((".pyc", ".pyo")) or "__pycache__" in path.split("/")
    return is_test_path(path) or name in PYTEST_CONFIG or startup or bytecode


def shadows_stdlib(path: str) -> bool:
    """A top-level `name.py` or `name/__init__.py` where `name` is a standard library module."""
    parts = path.split("/")
    if len(parts) == 1 and parts[0].endswith(".py"):
        return parts[0][:-3] in sys.stdlib_module_names
    return len(parts) == 2 and parts[1] == "__init__.py" and parts[0] in sys.stdlib_module_names


def protected_paths(diff: str) -> list[str]:
    """The paths of `diff` a fair solution must not touch or create (BadDiff if it does not parse)."""
    added = set(added_test_modules(diff))
    created = {
        path
        for file in parse_diff(diff)
        if (file.is_added_file or file.is_rename) and (path := diff_path(file.target_file)) is not None
    }
    return [
        path
        for path in touched_paths(diff)
        if (is_protected(path) and path not in added) or (path in created and shadows_stdlib(path))
    ]
