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

With --crucible-guard=SPEC (a JSON file: the lines the graded change added, by path) it installs a
runtime guard before pytest starts, so before any test or code under test is imported: an audit hook
(`sys.addaudithook`, which nothing can remove) that watches what reaches past the behaviour graded
(frames, code objects, the garbage collector, signals to pytest, ctypes, the report's folder, the test
files, writes outside the workspace, other audit hooks) and attributes each event to the workspace line
that caused it. An event caused by a line the change added is refused (the call raises) and written at
once to GUARD_LOG, out of band: the refused call never returns what it asked for, so there is nothing
to undo afterwards. See `_Guard`.

It runs inside the sandbox under the task's Python: it imports nothing of Crucible.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
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
GUARD_LOG = "guard.jsonl"
"""The guard's findings, one JSON object per line, written beside the report."""


def pytest_addoption(parser):
    parser.addoption("--crucible-report", default=None, help="write per-test results here (JSON lines)")
    parser.addoption("--crucible-guard", default=None, help="guard the run (read before pytest starts)")


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


# The guard. Each watched event has a rule and a way to find its culprit, the workspace line behind it.
# DIRECT looks at the Python frame that made the call only: a library's own use is its business.
# WALK looks through library frames (the standard library, installed packages) and code made at run
# time (exec'd strings, modules written outside the workspace) to the innermost workspace frame, so
# `inspect.stack()`, `operator.attrgetter`, a `ThreadPoolExecutor` or `exec` hide nothing. A walk that
# has met only library frames stops without a culprit at an import (a module's own set-up) and at an
# OWNERS frame, whose frame reads are bookkeeping that hands no frame back (logging's caller,
# namedtuple's and TypeVar's module, a formatted exception, a function's signature). On a thread
# other than the main one, a walk that meets no workspace frame blames the change: only code under
# test starts threads there.
DIRECT, WALK = "direct", "walk"
_FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
_CODE_ATTRIBUTES = frozenset({"__code__", "gi_code", "cr_code", "ag_code"})
_EVENTS = {
    "sys._getframe": ("frame-introspection", WALK),
    "sys._current_frames": ("frame-introspection", WALK),
    "sys.settrace": ("frame-introspection", WALK),
    "sys.setprofile": ("frame-introspection", WALK),
    "sys.addaudithook": ("frame-introspection", WALK),
    "gc.get_objects": ("gc-walk", WALK),
    "gc.get_referrers": ("gc-walk", WALK),
    "gc.get_referents": ("gc-walk", WALK),
    "code.__new__": ("dynamic-code", DIRECT),
    "function.__new__": ("dynamic-code", DIRECT),
    "os.kill": ("exit-hooks", WALK),
    "os.killpg": ("exit-hooks", WALK),
}
_PATH_EVENTS = frozenset(
    {"open", "os.remove", "os.rename", "os.truncate", "os.chmod", "os.symlink", "os.link"}
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_FORMATTERS = frozenset({
    "format_exc", "print_exc", "format_exception", "print_exception", "format_tb", "print_tb",
    "print_last", "format_exception_only",
})  # fmt: skip
OWNERS: dict[str, frozenset[str] | None] = {  # module -> its functions that own their frame reads (None: all)
    "logging": frozenset({"_log"}),
    "typing": None,
    "collections": None,
    "enum": None,
    "warnings": None,
    "traceback": _FORMATTERS,
    "inspect": frozenset({"_signature_from_function", "_has_code_flag"}),  # signature, iscoroutinefunction
}


class _Refused(PermissionError):
    """What a refused call raises."""


class _Guard:
    def __init__(self, spec_path: str, log_path: str) -> None:
        import site
        import sysconfig

        with open(spec_path, encoding="utf-8") as f:
            spec = json.load(f)
        self.root = os.getcwd()
        self.prefix = self.root.rstrip("/") + "/"
        self.added = {self.prefix + path: frozenset(lines) for path, lines in spec["added"].items()}
        self.protected = frozenset(self.prefix + path for path in spec["protected"])
        self.stems = frozenset(
            os.path.basename(path)[:-3] for path in spec["protected"] if path.endswith(".py")
        )
        paths = sysconfig.get_paths()
        libraries = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
        libraries |= {*site.getsitepackages(), os.path.dirname(os.path.abspath(__file__))}
        self.libraries = tuple(path.rstrip("/") + "/" for path in libraries)
        self.named = (*self.libraries, self.prefix)  # code compiled under these names passes for theirs
        self.report_dir = os.path.dirname(os.path.abspath(log_path)) + "/"
        self.temp = os.path.abspath(os.environ.get("TMPDIR") or "/tmp")
        self.main = threading.get_ident()
        self.busy: set[int] = set()  # threads inside the hook (its own frame reads are audited too)
        self.fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def __call__(self, event: str, args: tuple) -> None:
        if event in _EVENTS:
            rule, how = _EVENTS[event]
            detail = event
        elif event == "object.__getattr__" and len(args) == 2 and args[1] in _FRAME_ATTRIBUTES:
            rule, how, detail = "frame-introspection", WALK, str(args[1])
        elif event == "object.__getattr__" and len(args) == 2 and args[1] in _CODE_ATTRIBUTES:
            rule, how, detail = "code-access", WALK, str(args[1])
        elif event == "object.__setattr__" and len(args) >= 2 and args[1] in _CODE_ATTRIBUTES:
            rule, how, detail = "dynamic-code", DIRECT, f"sets {args[1]}"
        elif event.startswith("ctypes."):
            rule, how, detail = "module-patching", WALK, event
        elif (
            event == "compile"
            and len(args) == 2
            and isinstance(args[1], str)
            and args[1].startswith(self.named)
        ):
            rule, how, detail = "dynamic-code", WALK, f"compiles code as {args[1]}"
        elif event in _PATH_EVENTS and args:
            found = self._path_rule(event, args)
            if found is None:
                return
            (rule, detail), how = found, WALK
        else:
            return
        me = threading.get_ident()
        if me in self.busy:
            return
        self.busy.add(me)
        try:
            culprit = self._culprit(sys._getframe(1), how, me)
        finally:
            self.busy.discard(me)
        if culprit is None:
            return
        record = {"rule": rule, "path": culprit[0], "line": culprit[1], "detail": detail[:200]}
        try:
            os.write(self.fd, (json.dumps(record) + "\n").encode())
        except OSError:
            pass  # the log was closed under us: the call is refused all the same
        raise _Refused(f"refused by the grading guard: {rule} ({detail[:80]})")

    def _path_rule(self, event: str, args: tuple) -> tuple[str, str] | None:
        """(rule, detail) for a file event on what the code under test must not touch."""
        path = args[0]
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return None  # a file descriptor: opened by name before, and checked then
        path = os.path.abspath(path)
        name = path[len(self.prefix) :] if path.startswith(self.prefix) else path
        if path.startswith(self.report_dir):
            return "report-paths", f"{event} {path}"
        cached = "/__pycache__/" in path and os.path.basename(path).split(".")[0] in self.stems
        if path in self.protected or cached:
            return "test-sources", f"{event} {name}"
        writes = event != "open" or (
            len(args) >= 3
            and (
                (isinstance(args[1], str) and any(c in args[1] for c in "wax+"))
                or (isinstance(args[2], int) and bool(args[2] & _WRITE_FLAGS))
            )
        )
        if writes and path.startswith(self.prefix) and name.endswith(".py") and is_test_path(name):
            return "test-sources", f"{event} {name}"
        inside = any(path == top or path.startswith(top + "/") for top in (self.root, self.temp, "/dev"))
        return ("outside-writes", f"{event} {path}") if writes and not inside else None

    def _owns(self, frame) -> bool:
        module = str(frame.f_globals.get("__name__", "")).split(".")[0]
        if module not in OWNERS:
            return False
        functions = OWNERS[module]
        return functions is None or frame.f_code.co_name in functions

    def _culprit(self, frame, how: str, me: int) -> tuple[str, int] | None:
        """The added workspace line behind an event `frame` made (None: not the change's doing)."""
        library_only = True
        while frame is not None:
            file = frame.f_code.co_filename
            library = file.startswith(self.libraries) or file.startswith("<frozen")
            if not library and file.startswith(self.prefix):
                lines = self.added.get(file)
                if lines is not None and frame.f_lineno in lines:
                    return file[len(self.prefix) :], frame.f_lineno
                return None
            if how == DIRECT and library:
                return None
            if library_only and library and (file.startswith("<frozen importlib") or self._owns(frame)):
                return None
            library_only = library_only and library
            frame = frame.f_back
        return None if me == self.main else ("<a thread the code under test started>", 0)


def _guard(argv: list[str]) -> None:
    """Install the guard when argv asks for it; its log goes beside the report."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--crucible-guard=")), None)
    if spec is None:
        return
    report = next((a.split("=", 1)[1] for a in argv if a.startswith("--crucible-report=")), None)
    if report is None:
        raise SystemExit("--crucible-guard needs --crucible-report")
    sys.addaudithook(_Guard(spec, os.path.join(os.path.dirname(os.path.abspath(report)), GUARD_LOG)))


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
    _guard(sys.argv[1:])
    code = int(pytest.main(sys.argv[1:], plugins=[sys.modules[__name__]]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no atexit hooks: one the code under test registered could rewrite the report
