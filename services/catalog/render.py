"""Turn placed units and probe outcomes into the files of a repository: modules, tests, README, patch."""

from __future__ import annotations

import difflib
import re
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from crucible.probes import wants_approx
from services.catalog.evaluate import Outcome


@dataclass(frozen=True, kw_only=True)
class Case:
    """One test: a probe (already rendered with real names) and the outcome the fixed code gives."""

    name: str
    setup: str
    expr: str
    expected: Outcome


def module_source(
    *, doc: str, stdlib: Sequence[str], imports: Mapping[str, Iterable[str]], bodies: Sequence[str]
) -> str:
    """A module: docstring, stdlib imports, relative imports from sibling modules, then the bodies."""
    head = [f'"""{doc}"""', ""]
    if stdlib:
        head += [f"import {name}" for name in sorted(set(stdlib))] + [""]
    if imports:
        head += [
            f"from .{module} import {', '.join(sorted(names))}" for module, names in sorted(imports.items())
        ]
        head.append("")
    parts = ["\n".join(head).rstrip() + "\n"] + [body.strip("\n") + "\n" for body in bodies]
    return "\n\n".join(parts)


def test_source(
    *, doc: str, package: str, exports: Mapping[str, str], cases: Sequence[Case], probes: bool = False
) -> str:
    """A pytest file importing the names its cases use from the modules that define them. Each case
    asserts its expected outcome, or with `probes` (hidden tests) hands its call to the `crucible_probe`
    fixture and holds no expected value at all (see `crucible.probes`)."""
    used = {word for case in cases for word in re.findall(r"[A-Za-z_]\w*", case.setup + " " + case.expr)}
    by_module: dict[str, list[str]] = {}
    for name in sorted(used & exports.keys()):
        by_module.setdefault(exports[name], []).append(name)
    needs_pytest = not probes and any(
        line.startswith(("with pytest", "assert")) and "pytest." in line
        for c in cases
        for line in assertion(c.expr, c.expected)
    )
    lines = [f'"""{doc}"""', ""] + (["import pytest", ""] if needs_pytest else [])
    lines += [
        f"from {package}.{module} import {', '.join(names)}" for module, names in sorted(by_module.items())
    ]
    for case in cases:
        if probes:
            lines += ["", "", f"def {case.name}(crucible_probe):", "    def call():"]
            lines += [textwrap.indent(line, "        ") for line in case.setup.splitlines()]
            lines += [f"        return {case.expr}", "", "    crucible_probe(call)"]
            continue
        lines += ["", "", f"def {case.name}():"]
        lines += [textwrap.indent(line, "    ") for line in case.setup.splitlines()]
        lines += [f"    {line}" for line in assertion(case.expr, case.expected)]
    return "\n".join(lines) + "\n"


def assertion(expr: str, expected: Outcome) -> list[str]:
    if expected.error is not None:
        return [f"with pytest.raises({expected.error}):", f"    {expr}"]
    if wants_approx(expected.value):
        return [f"assert {expr} == pytest.approx({expected.value!r})"]
    if expected.value is None or isinstance(expected.value, bool):
        return [f"assert {expr} is {expected.value!r}"]
    return [f"assert {expr} == {expected.value!r}"]


def test_name(*, function: str, taken: set[str]) -> str:
    snake = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", function))
    base = f"test_{snake.lower()}"
    n = 1
    while f"{base}_{n}" in taken:
        n += 1
    taken.add(f"{base}_{n}")
    return f"{base}_{n}"


def readme(*, package: str, description: str, modules: Mapping[str, Sequence[tuple[str, str, str]]]) -> str:
    """README listing each module's functions (name, signature, summary)."""
    lines = [f"# {package}", "", description, "", "## Modules", ""]
    for module, entries in modules.items():
        lines.append(f"### `{package}/{module}.py`")
        lines.append("")
        lines += [f"- `{signature}`: {summary}." for _, signature, summary in entries]
        lines.append("")
    lines += ["## Development", "", "```", "python -m pytest", "```", ""]
    return "\n".join(lines)


def pyproject(*, package: str, version: str) -> str:
    return textwrap.dedent(
        f"""\
        [project]
        name = "{package}"
        version = "{version}"
        requires-python = ">=3.10"

        [tool.pytest.ini_options]
        pythonpath = ["."]
        testpaths = ["tests"]
        """
    )


def unified_patch(*, before: Mapping[str, str], after: Mapping[str, str]) -> str:
    """A git-style unified diff (a/ and b/ prefixes) of every file whose text changed."""
    chunks = []
    for path in sorted(before):
        if before[path] == after[path]:
            continue
        diff = difflib.unified_diff(
            before[path].splitlines(keepends=True),
            after[path].splitlines(keepends=True),
            fromfile=f"a/{path}",
            tofile=f"b/{path}",
        )
        chunks.append(f"diff --git a/{path} b/{path}\n" + "".join(diff))
    return "".join(chunks)


def signature(source: str, name: str) -> str:
    """`name(args)` as written in the definition of `name` (for a class, its `__init__`) within `source`."""
    match = re.search(
        rf"^(?:def {re.escape(name)}(\(.*?\))|class {re.escape(name)}\b.*?):$", source, flags=re.MULTILINE
    )
    if match is None:
        raise ValueError(f"no definition of {name}")
    if match.group(1) is not None:
        return name + match.group(1)
    init = re.compile(r"^    def __init__\(self,? ?(.*?)\):$", flags=re.MULTILINE).search(source, match.end())
    return f"{name}({init.group(1) if init else ''})"
