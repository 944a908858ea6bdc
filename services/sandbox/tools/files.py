"""File tools that run on the host: read_file, list_dir, replace.

They touch only paths that resolve inside the workspace (see `paths`), open regular files only (a fifo
planted by the agent would block the service), and refuse files too large to hold in memory.
"""

from __future__ import annotations

import asyncio
import io
import os
import stat
from pathlib import Path
from typing import Annotated

import msgspec

from crucible.contracts.sandbox import ToolResult
from services.sandbox.paths import relative, resolve
from services.sandbox.session import Session
from services.sandbox.tools.registry import Args, ToolFailure, tool

Line = Annotated[int, msgspec.Meta(ge=1)]


def _read_text(session: Session, path: str) -> tuple[Path, str]:
    real = resolve(session.workspace, path)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise ToolFailure(f"{path}: no such file") from None
    if stat.S_ISDIR(st.st_mode):
        raise ToolFailure(f"{path}: is a directory (use list_dir)")
    if not stat.S_ISREG(st.st_mode):
        raise ToolFailure(f"{path}: not a regular file")
    if st.st_size > session.settings.max_file_bytes:
        raise ToolFailure(
            f"{path}: {st.st_size} bytes, over the {session.settings.max_file_bytes} byte limit"
        )
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        data = f.read(session.settings.max_file_bytes + 1)
    if b"\x00" in data[:8192]:
        raise ToolFailure(f"{path}: binary file")
    try:
        return real, data.decode()
    except UnicodeDecodeError:
        raise ToolFailure(f"{path}: not UTF-8 text") from None


class ReadFileArgs(Args):
    path: str
    start_line: Line = 1
    end_line: Line | None = None


def _read_file(session: Session, args: ReadFileArgs) -> ToolResult:
    _, text = _read_text(session, args.path)
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


@tool(
    name="read_file",
    args=ReadFileArgs,
    aliases=("cat", "open_file"),
    description="Read a text file of the repository, optionally a range of lines (1-based, inclusive).",
)
async def read_file(session: Session, args: ReadFileArgs) -> ToolResult:
    return await asyncio.to_thread(_read_file, session, args)


class ListDirArgs(Args):
    path: str = "."


def _list_dir(session: Session, args: ListDirArgs) -> ToolResult:
    real = resolve(session.workspace, args.path)
    if not real.is_dir():
        raise ToolFailure(f"{args.path}: not a directory")
    with os.scandir(real) as it:
        entries = sorted(it, key=lambda e: e.name)
    names = [e.name + ("@" if e.is_symlink() else "/" if e.is_dir() else "") for e in entries]
    limit = session.settings.list_max_entries
    output = "\n".join(names[:limit]) if names else "(empty)"
    if len(names) > limit:
        output += f"\n[... {len(names) - limit} more entries]"
    return ToolResult(ok=True, output=output, truncated=len(names) > limit)


@tool(
    name="list_dir",
    args=ListDirArgs,
    aliases=("ls",),
    description="List a directory of the repository: directories end with /, symlinks with @.",
)
async def list_dir(session: Session, args: ListDirArgs) -> ToolResult:
    return await asyncio.to_thread(_list_dir, session, args)


class ReplaceArgs(Args):
    path: str
    old: str
    new: str


def _replace(session: Session, args: ReplaceArgs) -> ToolResult:
    if not args.old:
        raise ToolFailure("old must not be empty")
    real, text = _read_text(session, args.path)
    count = text.count(args.old)
    if count != 1:
        where = "not found" if count == 0 else f"found {count} times; include more context to make it unique"
        raise ToolFailure(f"{args.path}: old string {where}")
    at = text.index(args.old)
    updated = text[:at] + args.new + text[at + len(args.old) :]
    fd = os.open(real, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
        f.write(updated)
    first = text.count("\n", 0, at) + 1
    last = first + args.new.count("\n")
    return ToolResult(
        ok=True, output=f"{relative(session.workspace, real)}: replaced; new text at lines {first}-{last}"
    )


@tool(
    name="replace",
    args=ReplaceArgs,
    aliases=("str_replace", "edit"),
    description="Replace the one occurrence of `old` in a file with `new`; `old` must occur exactly once.",
)
async def replace(session: Session, args: ReplaceArgs) -> ToolResult:
    return await asyncio.to_thread(_replace, session, args)
