"""File tools, run on the host through `beneath` (no path can leave the workspace): read_file,
list_dir, replace, insert, create_file, undo_edit, delete_file, and SWE-agent's str_replace_editor,
which dispatches to them.

Every edit remembers what the file held before, so `undo_edit` can put it back.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from typing import Annotated, Literal

import msgspec

from crucible.contracts.sandbox import ToolResult
from services.sandbox.isolation.beneath import PathRefused, relative_name
from services.sandbox.session import Session
from services.sandbox.tools.registry import Args, ToolFailure, tool

Line = Annotated[int, msgspec.Meta(ge=1)]
PATH_ALIASES = {"target_file": "path", "file_path": "path", "relative_workspace_path": "path", "file": "path"}


def _read_text(session: Session, path: str) -> str:
    data = session.files.read_bytes(path, limit=session.settings.max_file_bytes)
    if b"\x00" in data[:8192]:
        raise ToolFailure(f"{path}: binary file")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ToolFailure(f"{path}: not UTF-8 text") from None


def _write_text(session: Session, path: str, text: str, *, create: bool) -> bool:
    data = text.encode()
    if len(data) > session.settings.max_file_bytes:
        raise ToolFailure(f"{path}: {len(data)} bytes, over the {session.settings.max_file_bytes} byte limit")
    free = session.workspace.free_bytes()
    if free is not None and len(data) > free:
        raise ToolFailure(f"{path}: the workspace's disk quota is full")
    try:
        return session.files.write_bytes(path, data, create=create, owner=session.sandbox.owner)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ToolFailure(f"{path}: the workspace's disk quota is full") from None
        raise


def _key(session: Session, path: str) -> str:
    """How the edit history names a file: its real place in the workspace."""
    try:
        return session.files.real(path)
    except FileNotFoundError:
        return os.path.normpath(relative_name(path))


def _previous(session: Session, path: str) -> bytes | None:
    try:
        return session.files.read_bytes(path, limit=session.settings.max_file_bytes)
    except FileNotFoundError:
        return None


class ReadFileArgs(Args):
    path: str
    start_line: Line = 1
    end_line: Line | None = None


@tool(
    name="read_file",
    args=ReadFileArgs,
    aliases=("cat", "open_file", "view"),
    arg_aliases={
        **PATH_ALIASES,
        "start_line_one_indexed": "start_line",
        "end_line_one_indexed_inclusive": "end_line",
    },
    description="Read a text file of the repository, optionally a range of lines (1-based, inclusive); "
    "at most read_max_lines lines per call.",
)
def read_file(session: Session, args: ReadFileArgs) -> ToolResult:
    text = _read_text(session, args.path)
    lines = io.StringIO(text, newline="\n").readlines()
    count = len(lines)
    if count == 0:
        return ToolResult(ok=True, output="")
    if args.start_line > count:
        raise ToolFailure(f"{args.path}: start_line {args.start_line} is past the end ({count} lines)")
    end = min(args.end_line or count, count)
    if end < args.start_line:
        raise ToolFailure(f"end_line {end} is before start_line {args.start_line}")
    shown = min(end, args.start_line + session.settings.read_max_lines - 1)
    output = "".join(lines[args.start_line - 1 : shown])
    if shown < end:
        output += (
            f"\n[... lines {args.start_line}-{shown} of {count} shown; read on with start_line={shown + 1}]"
        )
    return ToolResult(ok=True, output=output, truncated=shown < end)


class ListDirArgs(Args):
    path: str = "."


@tool(
    name="list_dir",
    args=ListDirArgs,
    aliases=("ls",),
    arg_aliases={**PATH_ALIASES, "target_directory": "path", "dir": "path"},
    description="List a directory of the repository: directories end with /, symlinks with @.",
)
def list_dir(session: Session, args: ListDirArgs) -> ToolResult:
    fd = session.files.open(args.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with os.scandir(fd) as it:
            entries = sorted(it, key=lambda e: e.name)
        names = []
        for e in entries:
            st = e.stat(follow_symlinks=False)
            kind = "@" if stat.S_ISLNK(st.st_mode) else "/" if stat.S_ISDIR(st.st_mode) else ""
            size = f"  ({st.st_size} bytes)" if stat.S_ISREG(st.st_mode) else ""
            names.append(f"{e.name}{kind}{size}")
    finally:
        os.close(fd)
    limit = session.settings.list_max_entries
    output = "\n".join(names[:limit]) if names else "(empty)"
    if len(names) > limit:
        output += f"\n[... {len(names) - limit} more entries]"
    return ToolResult(ok=True, output=output, truncated=len(names) > limit)


class ReplaceArgs(Args):
    path: str
    old: str
    new: str


@tool(
    name="replace",
    args=ReplaceArgs,
    aliases=("str_replace", "search_replace", "edit"),
    arg_aliases={
        **PATH_ALIASES,
        "old_str": "old",
        "new_str": "new",
        "old_string": "old",
        "new_string": "new",
    },
    description="Replace the one occurrence of `old` in a file with `new`; `old` must occur exactly once.",
)
def replace(session: Session, args: ReplaceArgs) -> ToolResult:
    if not args.old:
        raise ToolFailure("old must not be empty")
    text = _read_text(session, args.path)
    count = text.count(args.old)
    if count != 1:
        where = "not found" if count == 0 else f"found {count} times; include more context to make it unique"
        raise ToolFailure(f"{args.path}: old string {where}")
    at = text.index(args.old)
    _write_text(session, args.path, text[:at] + args.new + text[at + len(args.old) :], create=False)
    session.remember(_key(session, args.path), text.encode())
    first = text.count("\n", 0, at) + 1
    last = first + args.new.count("\n")
    return ToolResult(ok=True, output=f"{args.path}: replaced; new text at lines {first}-{last}")


class InsertArgs(Args):
    path: str
    line: Annotated[int, msgspec.Meta(ge=0)]
    text: str


@tool(
    name="insert",
    args=InsertArgs,
    aliases=("insert_lines",),
    arg_aliases={**PATH_ALIASES, "insert_line": "line", "new_str": "text", "content": "text"},
    description="Insert text after line `line` of a file (0: at the top).",
)
def insert(session: Session, args: InsertArgs) -> ToolResult:
    text = _read_text(session, args.path)
    lines = io.StringIO(text, newline="\n").readlines()
    if args.line > len(lines):
        raise ToolFailure(f"{args.path}: line {args.line} is past the end ({len(lines)} lines)")
    if lines and not lines[-1].endswith("\n") and args.line == len(lines):
        lines[-1] += "\n"
    new = args.text if args.text.endswith("\n") or not args.text else args.text + "\n"
    updated = "".join(lines[: args.line]) + new + "".join(lines[args.line :])
    _write_text(session, args.path, updated, create=False)
    session.remember(_key(session, args.path), text.encode())
    return ToolResult(
        ok=True, output=f"{args.path}: inserted {new.count(chr(10))} lines after line {args.line}"
    )


class CreateFileArgs(Args):
    path: str
    content: str
    overwrite: bool = False


@tool(
    name="create_file",
    args=CreateFileArgs,
    aliases=("create", "write_file"),
    arg_aliases={**PATH_ALIASES, "file_text": "content", "contents": "content"},
    description=(
        "Create a file with the given content (its folders too); an existing file only with overwrite."
    ),
)
def create_file(session: Session, args: CreateFileArgs) -> ToolResult:
    before = _previous(session, args.path)
    if before is not None and not args.overwrite:
        raise ToolFailure(f"{args.path}: already exists (pass overwrite=true to replace it)")
    created = _write_text(session, args.path, args.content, create=True)
    session.remember(_key(session, args.path), before)
    verb = "created" if created else "overwritten"
    return ToolResult(ok=True, output=f"{args.path}: {verb} ({len(args.content.encode())} bytes)")


class UndoEditArgs(Args):
    path: str


@tool(
    name="undo_edit",
    args=UndoEditArgs,
    arg_aliases=PATH_ALIASES,
    description="Undo the last edit tool call on a file (replace, insert, create_file, delete_file).",
)
def undo_edit(session: Session, args: UndoEditArgs) -> ToolResult:
    history = session.edits.get(_key(session, args.path))
    if not history:
        raise ToolFailure(f"{args.path}: no edit to undo")
    before = history.pop()
    if before is None:
        session.files.unlink(args.path)
        return ToolResult(ok=True, output=f"{args.path}: undone (the file it created is deleted)")
    session.files.write_bytes(args.path, before, create=True, owner=session.sandbox.owner)
    session.generation += 1
    return ToolResult(ok=True, output=f"{args.path}: last edit undone")


class DeleteFileArgs(Args):
    path: str


@tool(
    name="delete_file",
    args=DeleteFileArgs,
    aliases=("rm", "delete"),
    arg_aliases=PATH_ALIASES,
    description="Delete a file (not a directory); undo_edit brings it back.",
)
def delete_file(session: Session, args: DeleteFileArgs) -> ToolResult:
    try:
        before = _previous(session, args.path)
    except PathRefused:
        # Too large to keep for undo_edit, or not a regular file: deleted all the same (unlink checks
        # the path itself), and its older edits can no longer be undone.
        session.files.unlink(args.path)
        session.edits.pop(os.path.normpath(relative_name(args.path)), None)
        session.generation += 1
        return ToolResult(ok=True, output=f"{args.path}: deleted (undo_edit cannot bring this one back)")
    if before is None and not session.files.exists(args.path):
        raise ToolFailure(f"{args.path}: no such file")
    key = _key(session, args.path)
    session.files.unlink(args.path)
    session.remember(key, before)
    return ToolResult(ok=True, output=f"{args.path}: deleted")


class EditorArgs(Args):
    command: Literal["view", "create", "str_replace", "insert", "undo_edit"]
    path: str
    file_text: str | None = None
    old_str: str | None = None
    new_str: str | None = None
    insert_line: Annotated[int, msgspec.Meta(ge=0)] | None = None
    view_range: list[int] | None = None


def _need(value: object, name: str, command: str) -> object:
    if value is None:
        raise ToolFailure(f"str_replace_editor {command} needs {name}")
    return value


@tool(
    name="str_replace_editor",
    args=EditorArgs,
    description="SWE-agent's editor: command view | create | str_replace | insert | undo_edit on path.",
)
def str_replace_editor(session: Session, args: EditorArgs) -> ToolResult:
    path = args.path
    if args.command == "view":
        if session.files.exists(path) and stat.S_ISDIR(session.files.stat(path).st_mode):
            return list_dir(session, ListDirArgs(path=path))
        window = args.view_range or [1, -1]
        if not 1 <= len(window) <= 2 or window[0] < 1:
            raise ToolFailure("view_range is [start, end] with start >= 1 (end -1: to the end)")
        start, end = window[0], window[1] if len(window) == 2 else -1
        return read_file(
            session, ReadFileArgs(path=path, start_line=start, end_line=None if end < 1 else end)
        )
    if args.command == "create":
        text = _need(args.file_text, "file_text", "create")
        return create_file(session, CreateFileArgs(path=path, content=str(text)))
    if args.command == "str_replace":
        old = _need(args.old_str, "old_str", "str_replace")
        return replace(session, ReplaceArgs(path=path, old=str(old), new=args.new_str or ""))
    if args.command == "insert":
        line = _need(args.insert_line, "insert_line", "insert")
        text = _need(args.new_str, "new_str", "insert")
        return insert(session, InsertArgs(path=path, line=int(line), text=str(text)))  # type: ignore[call-overload]
    return undo_edit(session, UndoEditArgs(path=path))
