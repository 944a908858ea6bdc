"""grep: ripgrep over the workspace, on the host (it never follows symlinks it was not given)."""

from __future__ import annotations

import os

from crucible.contracts.sandbox import ToolResult
from services.sandbox.paths import relative, resolve
from services.sandbox.process import execute
from services.sandbox.session import Session
from services.sandbox.tools.registry import Args, ToolFailure, tool

GREP_TIMEOUT_S = 30.0
LINE_BYTES = 400
RG = (
    "rg --no-config --no-messages --line-number --no-heading --with-filename --color never --sort path "
    "--max-columns 300 --max-columns-preview"
).split()


class GrepArgs(Args):
    pattern: str
    path: str = "."
    include: str | None = None  # glob, e.g. "*.py"


@tool(
    name="grep",
    args=GrepArgs,
    aliases=("search", "rg"),
    description="Search file contents with a regular expression (ripgrep syntax); prints path:line:text.",
)
async def grep(session: Session, args: GrepArgs) -> ToolResult:
    if not args.pattern:
        raise ToolFailure("pattern must not be empty")
    real = resolve(session.workspace, args.path)
    if not real.exists():
        raise ToolFailure(f"{args.path}: no such file or directory")
    argv = [*RG, "--regexp", args.pattern]
    if args.include:
        argv += ["--glob", args.include]
    where = relative(session.workspace, real)
    argv += ["--", where] if where != "." else []
    limit = session.settings.grep_max_matches
    result = await execute(
        argv,
        timeout_s=GREP_TIMEOUT_S,
        output_cap=limit * LINE_BYTES,
        keep_tail=False,
        cwd=os.path.realpath(session.workspace),
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    if result.timed_out:
        raise ToolFailure(f"grep timed out after {GREP_TIMEOUT_S:g}s")
    if result.exit_code == 1:
        return ToolResult(ok=True, output="no matches", exit_code=1)
    if result.exit_code != 0:
        raise ToolFailure(f"grep failed: {result.output.strip()}")
    lines = result.output.splitlines()
    if result.truncated:
        lines = lines[:-2]  # the omission marker and a cut line
    truncated = result.truncated or len(lines) > limit
    output = "\n".join(lines[:limit]) + (
        f"\n[... more than {limit} matches; narrow the search]" if truncated else ""
    )
    return ToolResult(ok=True, output=output, truncated=truncated, exit_code=0)
