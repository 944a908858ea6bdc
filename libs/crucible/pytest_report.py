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
from typing import Any

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
#
# Values: each `==` in a hidden test's asserts is rewritten (when pytest rewrites the module's asserts)
# into a call that hands the guard both sides and the result, through an audited read no other code
# can make from a test file's frame (`_MARK`). When the `==` was true and either side's `__eq__` is
# not one the guard trusts (a builtin's, a library's, a repository's the change left alone), the two
# sides must encode alike: exact types, builtin containers by their items, any other object by its
# class and the state the garbage collector sees, never through its own methods. A hidden test
# module pytest executes without the rewrite (while rewriting is on, and the module did not opt out
# with PYTEST_DONT_REWRITE) is refused.
DIRECT, WALK = "direct", "walk"
_MARK = ("_crucible_eq", "_crucible_lhs", "_crucible_rhs")
_REWRITE_EVENT = "crucible.rewrite"
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


def _make_guard(spec_path: str, log_path: str, rewrite_code: object):
    """The audit hook. Everything it uses is bound here, in closure cells no other code can reach: the
    hook itself is reachable from nowhere (Python lists no audit hooks), while a module global, a class
    attribute or a builtin could be replaced by the code under test."""
    import ast
    import fnmatch
    import gc
    import site
    import sysconfig
    import types

    _type, _len, _tuple, _frozenset, _str, _int, _bytes = type, len, tuple, frozenset, str, int, bytes
    _isinstance, _setattr, _any, _sum, _list = isinstance, setattr, any, sum, list
    syntax = types.SimpleNamespace(**vars(ast))  # the ast module as it is now, in a copy of our own
    getframe, get_ident, referents = sys._getframe, threading.get_ident, gc.get_referents
    write, dumps, fsdecode, abspath = os.write, json.dumps, os.fsdecode, os.path.abspath
    fnmatchcase, code_type = fnmatch.fnmatchcase, _type(_make_guard.__code__)
    type_attribute, dict_items, refused = type.__getattribute__, dict.items, _Refused
    function_type, slot_type = _type(lambda: 0), _type(object.__eq__)
    scalars = (int, float, complex, str, bytes, bool, type(None))
    frame_attributes = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
    code_attributes = frozenset(
        {"__code__", "gi_code", "cr_code", "ag_code", "__defaults__", "__kwdefaults__"}
    )
    events = {
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
    path_events = frozenset(
        {"open", "os.remove", "os.rename", "os.truncate", "os.chmod", "os.symlink", "os.link"}
    )
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    owners = dict(OWNERS)
    test_dirs, test_patterns = TEST_DIRS, TEST_FILE_PATTERNS

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    root = os.getcwd()
    prefix = root.rstrip("/") + "/"
    added = {prefix + path: _frozenset(lines) for path, lines in spec["added"].items()}
    protected = _frozenset(prefix + path for path in spec["protected"])
    paths = sysconfig.get_paths()
    libraries = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    libraries |= {*site.getsitepackages(), os.path.dirname(os.path.abspath(__file__))}
    libraries = _tuple(path.rstrip("/") + "/" for path in libraries)
    named = (*libraries, prefix)  # code compiled under these names would pass for theirs
    report_dir = os.path.dirname(os.path.abspath(log_path)) + "/"
    temp = os.path.abspath(os.environ.get("TMPDIR") or "/tmp")
    main = get_ident()
    busy: set[int] = set()  # threads inside the hook (its own reads are audited too)
    rewritten: dict[str, int] = {}  # hidden test file -> the `==` the rewrite instrumented in it
    rewriting: list[bool] = []  # [True] once pytest rewrote a module: it rewrites every test module
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def refuse(rule: str, path: str, line: int, detail: str):
        try:
            write(
                fd,
                (dumps({"rule": rule, "path": path, "line": line, "detail": detail[:200]}) + "\n").encode(),
            )
        except OSError:
            pass  # the log was closed under us: the call is refused all the same
        raise refused(f"refused by the grading guard: {rule} ({detail[:80]})")

    def is_test(path: str) -> bool:
        parts = path.split("/")
        return _any(part in test_dirs for part in parts) or _any(
            fnmatchcase(parts[-1], p) for p in test_patterns
        )

    def owns(frame) -> bool:
        module = _str(frame.f_globals.get("__name__", "")).split(".")[0]
        if module not in owners:
            return False
        functions = owners[module]
        return functions is None or frame.f_code.co_name in functions

    def culprit(frame, how: str, me: int) -> tuple[str, int] | None:
        """The added workspace line behind an event `frame` made (None: not the change's doing)."""
        library_only = True
        while frame is not None:
            file = frame.f_code.co_filename
            library = file.startswith(libraries) or file.startswith("<frozen")
            if not library and file.startswith(prefix):
                lines = added.get(file)
                if lines is not None and frame.f_lineno in lines:
                    return file[_len(prefix) :], frame.f_lineno
                return None
            if how == DIRECT and library:
                return None
            if library_only and library and (file.startswith("<frozen importlib") or owns(frame)):
                return None
            library_only = library_only and library
            frame = frame.f_back
        return None if me == main else ("<a thread the code under test started>", 0)

    def path_rule(event: str, args: tuple[Any, ...]) -> tuple[str, str] | None:
        """(rule, detail) for a file event on what the code under test must not touch."""
        path = args[0]
        if _type(path) is _bytes:
            path = fsdecode(path)
        if _type(path) is not _str:
            return None  # a file descriptor: opened by name before, and checked then
        path = abspath(path)
        name = path[_len(prefix) :] if path.startswith(prefix) else path
        if path.startswith(report_dir):
            return "report-paths", f"{event} {path}"
        if path in protected:
            return "test-sources", f"{event} {name}"
        mode, flags = (args[1], args[2]) if _len(args) >= 3 else (None, None)
        writes = event != "open" or (_type(mode) is _str and _any(c in mode for c in "wax+"))
        writes = writes or (_type(flags) is _int and bool(flags & write_flags))
        if writes and path.startswith(prefix) and name.endswith(".py") and is_test(name):
            return "test-sources", f"{event} {name}"
        inside = _any(path == top or path.startswith(top + "/") for top in (root, temp, "/dev"))
        return ("outside-writes", f"{event} {path}") if writes and not inside else None

    def trusted(eq: object) -> bool:
        """An `__eq__` the change cannot have written: a builtin type's, or a function of a library or
        of the repository, none of whose lines the change added."""
        if _type(eq) is slot_type:
            return True
        if _type(eq) is not function_type:
            return False
        code = eq.__code__  # type: ignore[attr-defined]
        file = code.co_filename
        if file.startswith(libraries):
            return True
        lines = added.get(file, ())
        return file.startswith(prefix) and not _any(line in lines for _, _, line in code.co_lines())

    def own_eq(cls: type) -> object:
        for base in type_attribute(cls, "__mro__"):
            namespace = type_attribute(base, "__dict__")
            if "__eq__" in namespace:
                return namespace["__eq__"]
        return None

    def encode(value: Any, budget: list[int], depth: int = 0) -> object:
        budget[0] -= 1
        if depth > 20 or budget[0] < 0:
            return ("too deep",)
        kind = _type(value)
        for scalar in scalars:
            if kind is scalar:
                return (scalar.__name__, value)
        if kind is list or kind is tuple:
            return (kind.__name__, *(encode(item, budget, depth + 1) for item in value))  # type: ignore[attr-defined]
        if kind is dict:
            pairs = (
                (encode(k, budget, depth + 1), encode(v, budget, depth + 1)) for k, v in dict_items(value)
            )
            return ("dict", _frozenset(pairs))
        if kind is set or kind is frozenset:
            return (kind.__name__, _frozenset(encode(item, budget, depth + 1) for item in value))  # type: ignore[attr-defined]
        state = _tuple(encode(r, budget, depth + 1) for r in referents(value) if r is not kind)
        return (_str(type_attribute(kind, "__module__")), _str(type_attribute(kind, "__qualname__")), state)

    def check_values(function, frame) -> None:
        """Both sides of one `==` of a hidden test, with its result (see the comment above)."""
        result, left, right = function.__defaults__
        if not result or (trusted(own_eq(_type(left))) and trusted(own_eq(_type(right)))):
            return
        if encode(left, [10_000]) != encode(right, [10_000]):
            names = f"{_type(left).__qualname__} and {_type(right).__qualname__}"
            file = frame.f_code.co_filename
            refuse(
                "always-equal",
                file[_len(prefix) :],
                frame.f_lineno,
                f"an __eq__ the change wrote called {names} equal",
            )

    def markers(code) -> int:
        found = 1 if code.co_varnames[:3] == _MARK else 0
        return found + _sum(markers(c) for c in code.co_consts if _type(c) is _type(code))

    def name(n: str):
        return syntax.Name(n, syntax.Load())

    def function(params: list[str], defaults: list, body):
        arguments = syntax.arguments(
            posonlyargs=[],
            args=[syntax.arg(p) for p in params],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=defaults,
        )
        return syntax.Lambda(args=arguments, body=body)

    def observed(node):
        """`a == b` as `(lambda l, r: (lambda eq=l == r, lhs=l, rhs=r: 0).__defaults__[0])(a, b)`: each side
        evaluated once, in order, and the inner `__defaults__` read hands the guard both and the result."""
        compare = syntax.Compare(
            left=name("_crucible_l"), ops=[syntax.Eq()], comparators=[name("_crucible_r")]
        )
        inner = function(
            _list(_MARK), [compare, name("_crucible_l"), name("_crucible_r")], syntax.Constant(0)
        )
        seen = syntax.Subscript(
            syntax.Attribute(inner, "__defaults__", syntax.Load()), syntax.Constant(0), syntax.Load()
        )
        outer = function(["_crucible_l", "_crucible_r"], [], seen)
        return syntax.copy_location(syntax.Call(outer, [node.left, node.comparators[0]], []), node)

    def instrument(tree) -> int:
        """Rewrite each `a == b` of the module's asserts (outside nested scopes) so the guard sees it."""
        count = [0]
        nested = (syntax.Lambda, syntax.GeneratorExp, syntax.ListComp, syntax.SetComp, syntax.DictComp)

        def wrap(node):
            if _isinstance(node, nested):
                return node
            for field, value in syntax.iter_fields(node):
                if _isinstance(value, syntax.expr):
                    _setattr(node, field, wrap(value))
                elif _isinstance(value, _list):
                    _setattr(node, field, [wrap(v) if _isinstance(v, syntax.expr) else v for v in value])
            single = _isinstance(node, syntax.Compare) and _len(node.ops) == 1
            if single and _isinstance(node.ops[0], syntax.Eq):
                count[0] += 1
                return observed(node)
            return node

        for node in syntax.walk(tree):
            if _isinstance(node, syntax.Assert):
                node.test = wrap(node.test)
        syntax.fix_missing_locations(tree)
        return count[0]

    def hook(event: str, args: Any) -> None:
        if event in events:
            rule, how = events[event]
            detail = event
        elif event == "object.__getattr__" and _len(args) == 2 and args[1] in frame_attributes:
            rule, how, detail = "frame-introspection", WALK, _str(args[1])
        elif event == "object.__getattr__" and _len(args) == 2 and args[1] in code_attributes:
            rule, how, detail = "code-access", WALK, _str(args[1])
        elif event == "object.__setattr__" and _len(args) >= 2 and args[1] in code_attributes:
            rule, how, detail = "dynamic-code", DIRECT, f"sets {args[1]}"
        elif event.startswith("ctypes."):
            rule, how, detail = "module-patching", WALK, event
        elif event == "compile" and _len(args) == 2 and _type(args[1]) is _str and args[1].startswith(named):
            rule, how, detail = "dynamic-code", WALK, f"compiles code as {args[1]}"
        elif event in path_events and args:
            found = path_rule(event, args)
            if found is None:
                return
            (rule, detail), how = found, WALK
        elif event == _REWRITE_EVENT or event == "exec":
            rule, how, detail = "", "", ""
        else:
            return
        me = get_ident()
        if me in busy:
            return
        busy.add(me)
        try:
            caller = getframe(1)
            if event == _REWRITE_EVENT:  # pytest rewrites a module's asserts: instrument a hidden test's
                path = args[1] if _len(args) == 2 else None
                if caller.f_code is rewrite_code and _type(path) is _str and abspath(path) in protected:
                    rewritten[abspath(path)] = instrument(args[0])
                rewriting[:] = [True]
                return
            if event == "exec":
                code: Any = args[0] if args else None
                file = code.co_filename if _type(code) is code_type else None
                docstring = code.co_consts[0] if file is not None and code.co_consts else None
                opted_out = _type(docstring) is _str and "PYTEST_DONT_REWRITE" in docstring
                if file is not None and file in protected and rewriting and not opted_out:
                    if file not in rewritten or markers(code) < rewritten[file]:
                        refuse(
                            "pytest-internals",
                            file[_len(prefix) :],
                            0,
                            "a hidden test without its value check",
                        )
                return
            if (
                detail == "__defaults__"
                and _type(args[0]) is function_type
                and args[0].__code__.co_varnames[:3] == _MARK
            ):
                if caller.f_code.co_filename in protected:
                    check_values(args[0], caller)
                    return
            place = culprit(caller, how, me)
        finally:
            busy.discard(me)
        if place is not None:
            refuse(rule, place[0], place[1], detail)

    return hook


def _guard(argv: list[str]) -> None:
    """Install the guard when argv asks for it (its log goes beside the report), before pytest starts,
    and have pytest's assertion rewriting hand each module to it (`_REWRITE_EVENT`)."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--crucible-guard=")), None)
    if spec is None:
        return
    report = next((a.split("=", 1)[1] for a in argv if a.startswith("--crucible-report=")), None)
    if report is None:
        raise SystemExit("--crucible-guard needs --crucible-report")
    from _pytest.assertion import rewrite

    original, audit = rewrite.rewrite_asserts, sys.audit

    def rewrite_asserts(mod, source, module_path=None, config=None):
        audit(_REWRITE_EVENT, mod, module_path)
        return original(mod, source, module_path, config)

    sys.dont_write_bytecode = True  # every hidden test module is rewritten here, none read from a cache
    log = os.path.join(os.path.dirname(os.path.abspath(report)), GUARD_LOG)
    sys.addaudithook(_make_guard(spec, log, rewrite_asserts.__code__))
    rewrite.rewrite_asserts = rewrite_asserts


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
