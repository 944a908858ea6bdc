"""The agent's tools over a real session: arguments checked, paths kept inside the workspace."""

from __future__ import annotations

import asyncio
import os

import pytest

from services.sandbox.tools import TOOLS, call_tool


async def test_read_file_whole_and_by_range(session):
    whole = await call_tool(session, "read_file", {"path": "calc/ops.py"})
    assert whole.ok and whole.output.startswith("def add(a, b):\n    return a - b\n")
    part = await call_tool(session, "cat", {"path": "/workspace/calc/ops.py", "start_line": 2, "end_line": 2})
    assert part.output == "    return a - b\n"


async def test_read_file_caps_lines_per_call(session):
    result = await call_tool(session, "read_file", {"path": "README.md", "start_line": 10})
    assert result.ok and result.truncated
    assert (
        result.output.startswith("line 10\n")
        and "line 59\n" in result.output
        and "line 60\n" not in result.output
    )
    assert "read on with start_line=60" in result.output


@pytest.mark.parametrize(
    "arguments, error",
    [
        ({"path": "../../../../etc/passwd"}, "outside the workspace"),
        ({"path": "/etc/passwd"}, "must be under /workspace"),
        ({"path": "calc/missing.py"}, "no such file"),
        ({"path": "calc"}, "is a directory"),
        ({"path": "calc/ops.py", "start_line": 0}, "bad arguments"),
        ({"path": "calc/ops.py", "start_line": 99}, "past the end"),
        ({"path": "calc/ops.py", "bogus": 1}, "bad arguments"),
        ({}, "bad arguments"),
    ],
)
async def test_read_file_refuses(session, arguments, error):
    result = await call_tool(session, "read_file", arguments)
    assert not result.ok and error in (result.error or "")


async def test_planted_symlink_to_a_host_file_is_not_followed(session):
    run = await call_tool(
        session, "run", {"command": "ln -s /etc/passwd leak && ln -s / root && ln -s calc/ops.py inner"}
    )
    assert run.ok, run.output
    for name, arguments in [
        ("read_file", {"path": "leak"}),
        ("read_file", {"path": "root/etc/passwd"}),
        ("replace", {"path": "leak", "old": "root", "new": "toor"}),
        ("list_dir", {"path": "root"}),
        ("grep", {"pattern": "root", "path": "leak"}),
    ]:
        result = await call_tool(session, name, arguments)
        assert not result.ok and "outside the workspace" in (result.error or ""), (name, result)
    found = await call_tool(session, "grep", {"pattern": "root:"})
    assert found.ok and found.output == "no matches"
    inner = await call_tool(session, "read_file", {"path": "inner"})
    assert inner.ok and inner.output.startswith("def add")
    listing = await call_tool(session, "ls", {})
    assert [line.split()[0] for line in listing.output.splitlines()] == [
        "README.md",
        "calc/",
        "inner@",
        "leak@",
        "root@",
        "tests/",
    ]


async def test_fifo_is_refused_without_blocking(session):
    os.mkfifo(session.workspace.path / "pipe")
    result = await asyncio.wait_for(call_tool(session, "read_file", {"path": "pipe"}), timeout=5)
    assert not result.ok and "not a regular file" in (result.error or "")


async def test_replace_needs_exactly_one_match(session):
    missing = await call_tool(session, "replace", {"path": "calc/ops.py", "old": "a * b", "new": "x"})
    assert not missing.ok and "not found" in (missing.error or "")
    twice = await call_tool(session, "replace", {"path": "calc/ops.py", "old": "add(a", "new": "x"})
    assert not twice.ok and "found 2 times" in (twice.error or "")
    done = await call_tool(session, "str_replace", {"path": "calc/ops.py", "old": "a - b", "new": "a + b"})
    assert done.ok and "lines 2-2" in done.output
    assert (
        (session.workspace.path / "calc/ops.py").read_text().startswith("def add(a, b):\n    return a + b\n")
    )


async def test_grep_finds_matches_with_include_and_caps_them(session, settings):
    found = await call_tool(session, "grep", {"pattern": "def \\w+", "include": "*.py"})
    assert found.ok
    assert found.output.splitlines() == sorted(found.output.splitlines())
    assert (
        "calc/ops.py:1:def add(a, b):" in found.output
        and "tests/test_ops.py:4:def test_add():" in found.output
    )
    capped = await call_tool(session, "grep", {"pattern": "^line", "path": "README.md"})
    assert capped.truncated and len(capped.output.splitlines()) == settings.grep_max_matches + 1
    bad = await call_tool(session, "grep", {"pattern": "("})
    assert not bad.ok and "regex" in (bad.error or "")


async def test_run_tool_runs_the_tests_inside(session):
    result = await call_tool(session, "bash", {"command": "python -m pytest -q -p no:cacheprovider tests"})
    assert not result.ok and result.exit_code == 1 and "1 failed" in result.output
    slow = await call_tool(session, "run", {"command": "sleep 30", "timeout_s": 0.5})
    assert slow.timed_out and "timed out" in (slow.error or "")


async def test_unknown_tool_and_schemas(session):
    result = await call_tool(session, "format_disk", {})
    assert not result.ok and "unknown tool 'format_disk'" in (result.error or "")
    schema = TOOLS["replace"].schema()
    assert schema["name"] == "replace"
    assert set(schema["parameters"]["$defs"]["ReplaceArgs"]["required"]) == {"path", "old", "new"}
