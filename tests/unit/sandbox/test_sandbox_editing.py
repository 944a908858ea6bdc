"""The edit tools over a real session: insert, create_file, delete_file, undo_edit, SWE-agent's
str_replace_editor, and the argument names other agents use."""

from __future__ import annotations

import os

import pytest
from sandbox_archives import REPO

from services.sandbox.tools import call_tool

OPS = REPO["calc/ops.py"]


def text_of(session, path: str) -> str:
    return (session.workspace.path / path).read_text()


async def test_insert_at_the_top_in_the_middle_and_not_past_the_end(session):
    top = await call_tool(session, "insert", {"path": "calc/ops.py", "line": 0, "text": "import math"})
    assert top.ok, top
    assert text_of(session, "calc/ops.py") == "import math\n" + OPS
    middle = await call_tool(session, "insert", {"path": "calc/ops.py", "line": 3, "text": "    # add\n"})
    assert middle.ok and "after line 3" in middle.output
    assert text_of(session, "calc/ops.py").splitlines()[:4] == [
        "import math",
        "def add(a, b):",
        "    return a - b",
        "    # add",
    ]
    past = await call_tool(session, "insert", {"path": "calc/ops.py", "line": 99, "text": "x"})
    assert not past.ok and "past the end" in (past.error or "")
    negative = await call_tool(session, "insert", {"path": "calc/ops.py", "line": -1, "text": "x"})
    assert not negative.ok and "bad arguments" in (negative.error or "")


async def test_insert_after_a_last_line_without_newline(new_session):
    session = await new_session({"a.txt": "one\ntwo"})
    result = await call_tool(session, "insert", {"path": "a.txt", "line": 2, "text": "three"})
    assert result.ok and text_of(session, "a.txt") == "one\ntwo\nthree\n"


async def test_create_file_makes_its_folders_and_overwrites_only_when_asked(session):
    made = await call_tool(session, "create_file", {"path": "pkg/sub/new.py", "content": "X = 1\n"})
    assert made.ok and "created" in made.output
    assert text_of(session, "pkg/sub/new.py") == "X = 1\n"
    again = await call_tool(session, "create_file", {"path": "pkg/sub/new.py", "content": "X = 2\n"})
    assert not again.ok and "already exists" in (again.error or "")
    assert text_of(session, "pkg/sub/new.py") == "X = 1\n"
    existing = await call_tool(session, "create_file", {"path": "calc/ops.py", "content": "gone\n"})
    assert not existing.ok and text_of(session, "calc/ops.py") == OPS
    overwritten = await call_tool(
        session, "create_file", {"path": "calc/ops.py", "content": "new\n", "overwrite": True}
    )
    assert overwritten.ok and "overwritten" in overwritten.output
    assert text_of(session, "calc/ops.py") == "new\n"
    # What the sandbox sees, and can change further, is what the tool wrote.
    inside = await call_tool(session, "run", {"command": "cat pkg/sub/new.py && echo more >> pkg/sub/new.py"})
    assert inside.ok and inside.output == "X = 1\n", inside


async def test_delete_file_refuses_folders_and_missing_files(session):
    deleted = await call_tool(session, "delete_file", {"path": "README.md"})
    assert deleted.ok and not (session.workspace.path / "README.md").exists()
    folder = await call_tool(session, "delete_file", {"path": "calc"})
    assert not folder.ok and "is a directory" in (folder.error or "")
    assert (session.workspace.path / "calc/ops.py").exists()
    missing = await call_tool(session, "rm", {"path": "README.md"})
    assert not missing.ok and "no such file" in (missing.error or "")


async def test_delete_file_of_what_cannot_be_kept_for_undo(session, settings):
    size = settings.max_file_bytes + 1
    made = await call_tool(
        session,
        "run",
        {"command": f"head -c {size} /dev/zero > big.bin && ln -s /etc/passwd leak && mkfifo pipe"},
    )
    assert made.ok, made
    for name in ("big.bin", "leak", "pipe"):
        deleted = await call_tool(session, "delete_file", {"path": name})
        assert deleted.ok and "cannot bring this one back" in deleted.output, deleted
        assert not os.path.lexists(session.workspace.path / name)
        assert not (await call_tool(session, "undo_edit", {"path": name})).ok
    assert os.path.exists("/etc/passwd")
    outside = await call_tool(session, "delete_file", {"path": "calc/../../outside.txt"})
    assert not outside.ok and "outside the workspace" in (outside.error or "")


@pytest.mark.parametrize(
    "tool, arguments",
    [
        ("replace", {"path": "calc/ops.py", "old": "a - b", "new": "a + b"}),
        ("insert", {"path": "calc/ops.py", "line": 0, "text": "import os"}),
        ("create_file", {"path": "calc/ops.py", "content": "", "overwrite": True}),
        ("delete_file", {"path": "calc/ops.py"}),
    ],
)
async def test_undo_edit_puts_the_file_back(session, tool, arguments):
    edited = await call_tool(session, tool, arguments)
    assert edited.ok, edited
    assert not (session.workspace.path / "calc/ops.py").exists() or text_of(session, "calc/ops.py") != OPS
    undone = await call_tool(session, "undo_edit", {"path": "/workspace/calc/ops.py"})
    assert undone.ok, undone
    assert text_of(session, "calc/ops.py") == OPS
    assert await session.diff() == ""
    nothing = await call_tool(session, "undo_edit", {"path": "calc/ops.py"})
    assert not nothing.ok and "no edit to undo" in (nothing.error or "")


async def test_undo_edit_of_a_new_file_deletes_it_and_steps_back_one_edit_at_a_time(session):
    await call_tool(session, "create_file", {"path": "notes/todo.txt", "content": "a\n"})
    await call_tool(session, "replace", {"path": "notes/todo.txt", "old": "a", "new": "b"})
    await call_tool(session, "replace", {"path": "notes/todo.txt", "old": "b", "new": "c"})
    assert (await call_tool(session, "undo_edit", {"path": "notes/todo.txt"})).ok
    assert text_of(session, "notes/todo.txt") == "b\n"
    assert (await call_tool(session, "undo_edit", {"path": "notes/todo.txt"})).ok
    assert text_of(session, "notes/todo.txt") == "a\n"
    last = await call_tool(session, "undo_edit", {"path": "notes/todo.txt"})
    assert last.ok and "deleted" in last.output
    assert not (session.workspace.path / "notes/todo.txt").exists()


async def test_undo_edit_with_nothing_to_undo(session):
    result = await call_tool(session, "undo_edit", {"path": "calc/ops.py"})
    assert not result.ok and "calc/ops.py: no edit to undo" == result.error
    missing = await call_tool(session, "undo_edit", {"path": "never/was.py"})
    assert not missing.ok and "no edit to undo" in (missing.error or "")


async def test_str_replace_editor_views_files_and_folders(session):
    editor = "str_replace_editor"
    part = await call_tool(session, editor, {"command": "view", "path": "calc/ops.py", "view_range": [2, 3]})
    assert part.ok and part.output == "    return a - b\n\n"
    rest = await call_tool(session, editor, {"command": "view", "path": "calc/ops.py", "view_range": [5, -1]})
    assert rest.ok and rest.output == "def twice(a):\n    return add(a, a)\n"
    folder = await call_tool(session, editor, {"command": "view", "path": "/workspace/calc"})
    assert folder.ok and [line.split()[0] for line in folder.output.splitlines()] == ["__init__.py", "ops.py"]
    bad = await call_tool(session, editor, {"command": "view", "path": "calc/ops.py", "view_range": [0, 2]})
    assert not bad.ok and "view_range" in (bad.error or "")


async def test_str_replace_editor_edits_and_undoes(session):
    editor = "str_replace_editor"
    created = await call_tool(
        session, editor, {"command": "create", "path": "calc/neg.py", "file_text": "N = 1\n"}
    )
    assert created.ok and text_of(session, "calc/neg.py") == "N = 1\n"
    replaced = await call_tool(
        session,
        editor,
        {"command": "str_replace", "path": "calc/ops.py", "old_str": "a - b", "new_str": "a + b"},
    )
    assert replaced.ok and "return a + b" in text_of(session, "calc/ops.py")
    inserted = await call_tool(
        session, editor, {"command": "insert", "path": "calc/ops.py", "insert_line": 0, "new_str": "# ops"}
    )
    assert inserted.ok and text_of(session, "calc/ops.py").startswith(
        "# ops\ndef add(a, b):\n    return a + b"
    )
    undone = await call_tool(session, editor, {"command": "undo_edit", "path": "calc/ops.py"})
    assert undone.ok and text_of(session, "calc/ops.py").startswith("def add(a, b):\n    return a + b")
    missing = await call_tool(session, editor, {"command": "str_replace", "path": "calc/ops.py"})
    assert not missing.ok and "needs old_str" in (missing.error or "")
    unknown = await call_tool(session, editor, {"command": "format", "path": "calc/ops.py"})
    assert not unknown.ok and "bad arguments" in (unknown.error or "")


async def test_other_agents_argument_names_are_understood(session):
    cursor = await call_tool(
        session,
        "read_file",
        {
            "target_file": "calc/ops.py",
            "start_line_one_indexed": 2,
            "end_line_one_indexed_inclusive": 2,
            "explanation": "look at add",
        },
    )
    assert cursor.ok and cursor.output == "    return a - b\n"
    swe = await call_tool(
        session, "str_replace", {"file_path": "calc/ops.py", "old_str": "a - b", "new_str": "a + b"}
    )
    assert swe.ok, swe
    claude = await call_tool(
        session, "edit", {"file_path": "calc/ops.py", "old_string": "a + b", "new_string": "b + a"}
    )
    assert claude.ok and "return b + a" in text_of(session, "calc/ops.py")
    listing = await call_tool(session, "list_dir", {"target_directory": "calc", "explanation": "why not"})
    assert listing.ok and "ops.py" in listing.output


@pytest.mark.parametrize(
    "tool, arguments",
    [
        ("replace", {"path": "calc/ops.py", "old": "a - b", "new": "a + b", "count": 2}),
        ("read_file", {"target_file": "calc/ops.py", "path": "calc/ops.py"}),
        ("create_file", {"path": "x.py"}),
        ("insert", {"path": "calc/ops.py", "line": "first", "text": "x"}),
    ],
)
async def test_unknown_or_missing_arguments_are_a_clear_error(session, tool, arguments):
    result = await call_tool(session, tool, arguments)
    assert not result.ok and (result.error or "").startswith(f"bad arguments for {tool}")
    assert text_of(session, "calc/ops.py") == OPS and not (session.workspace.path / "x.py").exists()
