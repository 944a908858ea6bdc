"""Runs pytest with a plugin that writes one JSON line per test (node id, outcome, short message) to the file
named by --crucible-report; `read_report` reads it back. The sandbox's `run_tests` runs this file as the
script inside the sandbox, and the catalog runs it when it verifies a generated task: results come from
that file, never from the console, where the code under test can print anything (a fake "PASSED" too).
As the script, it is imported from its own folder, so a module of the same name planted in the
workspace cannot stand in for it.

It also serves the `crucible_probe` fixture of generated tasks' hidden tests: the test hands it a function,
and what the function returns (as a Python literal) or raises (the exception's class name) is written with
the test's result, to be judged outside the sandbox against an expected value that never enters it
(`crucible.probes`).

It runs inside the sandbox under the task's Python: it imports nothing of Crucible.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

COMMAND = ("python", "-m", "pytest")
"""How a task's test command starts; what follows it are pytest's arguments, run through this script."""
SCRIPT = "crucible_pytest_report.py"
TEST_DIRS = frozenset({"tests", "test"})
TEST_FILE_PATTERNS = ("test_*.py", "*_test.py", "conftest.py")
_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
_results: dict[str, dict[str, object]] = {}
_probes: dict[str, dict[str, str]] = {}
_PLAIN = (int, float, complex, str, bytes, bool, type(None))
_LITERAL_DEPTH = 20
VALUE_CHARS = 64 * 1024
"""A probe value whose repr is longer is not recorded (no expected value is that long)."""


def pytest_addoption(parser):
    parser.addoption("--crucible-report", default=None, help="write per-test results here (JSON lines)")


def _record(nodeid: str, outcome: str, duration: float, message: str) -> None:
    seen = _results.get(nodeid)
    if seen is None:
        _results[nodeid] = {"nodeid": nodeid, "outcome": outcome, "duration_s": duration, "message": message}
        return
    seen["duration_s"] = float(seen["duration_s"]) + duration  # type: ignore[arg-type]
    if _RANK[outcome] > _RANK[str(seen["outcome"])]:
        seen["outcome"], seen["message"] = outcome, message


def _message(report) -> str:
    text = getattr(report, "longreprtext", "") or ""
    lines = [line for line in text.splitlines() if line.startswith("E ")]
    return ("\n".join(lines[-5:]) or text[-500:])[:1000]


def pytest_runtest_logreport(report):
    if report.when == "call":
        outcome = "skipped" if report.skipped else "passed" if report.passed else "failed"
    elif report.failed:
        outcome = "error"  # setup or teardown failed
    elif report.skipped:
        outcome = "skipped"
    else:
        return
    _record(report.nodeid, outcome, float(getattr(report, "duration", 0.0)), _message(report))


def pytest_collectreport(report):
    if report.failed:
        _record(report.nodeid or "<collection>", "error", 0.0, _message(report))


def _plain(value: object, depth: int = 0) -> bool:
    """Whether `value` is built of exact builtin types only, so its repr is the literal of its value (a
    subclass could answer repr, or ==, as it likes)."""
    if depth > _LITERAL_DEPTH:
        return False
    kind = type(value)
    if kind in _PLAIN:
        return True
    if kind in (list, tuple, set):
        return all(_plain(item, depth + 1) for item in value)  # type: ignore[attr-defined]
    if kind is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())  # type: ignore[attr-defined]
    return False


def _probe_outcome(call) -> dict[str, str]:
    try:
        value = call()
    except Exception as exc:  # what the call raises is the outcome
        kind = type(exc)
        module = getattr(kind, "__module__", "")
        return {"raised": kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"}
    if not _plain(value):
        return {"unusable": f"a {type(value).__module__}.{type(value).__qualname__}"}
    text = repr(value)
    if len(text) > VALUE_CHARS:
        return {"unusable": f"a repr of {len(text)} characters"}
    return {"value": text}


def _crucible_probe(request):
    """Record what one call of the code under test gives; the test itself passes."""

    def probe(call) -> None:
        _probes[request.node.nodeid] = _probe_outcome(call)

    return probe


def pytest_configure(config):
    import types

    import pytest

    fixtures = types.ModuleType("crucible_probe_fixture")
    fixtures.crucible_probe = pytest.fixture(_crucible_probe, name="crucible_probe")  # type: ignore[attr-defined]
    config.pluginmanager.register(fixtures, "crucible-probe")


def pytest_sessionfinish(session, exitstatus):
    for nodeid, probed in _probes.items():
        if nodeid in _results:
            _results[nodeid]["probe"] = probed
    path = session.config.getoption("--crucible-report")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(result) + "\n" for result in _results.values())


def is_test_path(path: str) -> bool:
    """A test file or a file in a test folder, by pytest's conventions (the grader protects these; the
    catalog's synthesis never mutates them)."""
    import fnmatch

    parts = path.split("/")
    return any(part in TEST_DIRS for part in parts) or any(
        fnmatch.fnmatchcase(parts[-1], pattern) for pattern in TEST_FILE_PATTERNS
    )


def split_command(command: Sequence[str]) -> list[str]:
    """pytest's arguments in a task's test command; ValueError if it is not `python -m pytest ...`.
    (No `pytest_` prefix on this module's own functions: pytest would take them for hooks.)"""
    if tuple(command[: len(COMMAND)]) != COMMAND:
        raise ValueError(f"test command {list(command)} is not `python -m pytest ...`")
    return list(command[len(COMMAND) :])


def install(folder: Path) -> Path:
    """A copy of this script, alone in `folder`, to run: run from where it is installed, its folder
    (Crucible's own modules) would come first on the import path and shadow the tested code's."""
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(__file__, folder / SCRIPT))


def read_report(text: str) -> list[dict[str, object]]:
    """The results a report holds, one dict per test; ValueError names a line that is not one."""
    results = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            result = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"test report line {number} is not JSON: {exc}") from None
        named = isinstance(result, dict) and isinstance(result.get("nodeid"), str)
        if not named or not isinstance(result.get("outcome"), str) or result["outcome"] not in _RANK:
            raise ValueError(f"test report line {number} is not a test result: {line[:200]!r}")
        results.append(result)
    return results


if __name__ == "__main__":
    import pytest

    sys.path.insert(1, os.getcwd())  # the workspace importable, as under `python -m pytest`
    code = int(pytest.main(sys.argv[1:], plugins=[sys.modules[__name__]]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no atexit hooks: one the code under test registered could rewrite the report
