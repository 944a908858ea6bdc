"""run: a shell command inside the session's sandbox, with a timeout and an output cap."""

from __future__ import annotations

from typing import Annotated

import msgspec

from crucible.contracts.sandbox import ToolResult
from services.sandbox.session import Session
from services.sandbox.tools.registry import Args, ToolFailure, tool


class RunArgs(Args):
    command: str
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None


@tool(
    name="run",
    args=RunArgs,
    aliases=("bash", "shell"),
    description="Run a bash command in the repository (no network); output is capped, head and tail kept.",
)
async def run(session: Session, args: RunArgs) -> ToolResult:
    if not args.command.strip():
        raise ToolFailure("command must not be empty")
    s = session.settings
    timeout = min(args.timeout_s or s.run_timeout_s, s.max_run_timeout_s)
    return await session.sandboxed(["bash", "-lc", args.command], timeout_s=timeout)
