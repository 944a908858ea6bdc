"""Bus handlers: one per verb, each a thin translation from a request to the session manager."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from crucible.bus import RequestError
from crucible.contracts import endpoints
from crucible.contracts.endpoints import SessionEndpoint
from crucible.contracts.messages import Message
from crucible.contracts.sandbox import (
    AliveReply,
    AliveRequest,
    ApplyRequest,
    CreateReply,
    CreateRequest,
    DestroyReply,
    DestroyRequest,
    DiffReply,
    DiffRequest,
    ForkReply,
    ForkRequest,
    LimitsReply,
    LimitsRequest,
    OverlayRequest,
    RunRequest,
    ToolReply,
    ToolRequest,
    ToolResult,
)
from services.sandbox.isolation.archive import BadArchive
from services.sandbox.manager import SessionManager
from services.sandbox.metrics import RESULTS
from services.sandbox.tools import call_tool, lookup

Handler = Callable[[Any], Awaitable[Message]]


def _counted(verb: str, result: ToolResult, *, tool: str = "") -> ToolReply:
    """Requests are counted and timed by the bus; this counts what they did: which tool, and whether it
    worked (a failed tool call is still a good reply)."""
    RESULTS.labels(verb=verb, tool=tool, ok=str(result.ok).lower()).inc()
    return ToolReply(result=result)


class Handlers:
    def __init__(self, *, manager: SessionManager) -> None:
        self.manager = manager
        self.settings = manager.settings

    def routes(self) -> dict[SessionEndpoint, Handler]:
        """Per-session calls, served on sandbox.<replica>.<verb>."""
        return {
            endpoints.SANDBOX_TOOL: self.tool,
            endpoints.SANDBOX_DIFF: self.diff,
            endpoints.SANDBOX_APPLY: self.apply,
            endpoints.SANDBOX_RUN: self.run,
            endpoints.SANDBOX_OVERLAY: self.overlay,
            endpoints.SANDBOX_DESTROY: self.destroy,
            endpoints.SANDBOX_FORK: self.fork,
            endpoints.SANDBOX_ALIVE: self.alive,
        }

    async def create(self, req: CreateRequest) -> CreateReply:
        session = await self.manager.create(
            run_id=req.run_id, task_id=req.task_id, snapshot=req.snapshot, ttl_s=req.ttl_s
        )
        return CreateReply(session_id=session.id, replica=self.settings.replica)

    async def tool(self, req: ToolRequest) -> ToolReply:
        session = self.manager.get(req.session_id)
        result = await session.exclusive(lambda: call_tool(session, req.name, req.arguments))
        known = lookup(req.name)
        return _counted("tool", result, tool=known.name if known else "unknown")

    async def diff(self, req: DiffRequest) -> DiffReply:
        session = self.manager.get(req.session_id)
        return DiffReply(diff=await session.exclusive(session.diff))

    async def apply(self, req: ApplyRequest) -> ToolReply:
        session = self.manager.get(req.session_id)
        return _counted("apply", await session.exclusive(lambda: session.apply_patch(req.patch)))

    async def run(self, req: RunRequest) -> ToolReply:
        session = self.manager.get(req.session_id)
        if (req.argv is None) == (req.command is None):
            raise RequestError("bad_request", "give exactly one of argv and command")
        argv = req.argv if req.argv is not None else ["bash", "-lc", req.command or ""]
        if not argv or not argv[0]:
            raise RequestError("bad_request", "empty command")
        s = self.settings
        timeout = min(req.timeout_s or s.run_timeout_s, s.max_run_timeout_s)
        cap = min(req.output_cap or s.output_cap_bytes, s.max_output_cap_bytes)
        if timeout <= 0 or cap <= 0:
            raise RequestError("bad_request", "timeout_s and output_cap must be positive")
        result = await session.exclusive(lambda: session.sandboxed(argv, timeout_s=timeout, output_cap=cap))
        return _counted("run", result)

    async def overlay(self, req: OverlayRequest) -> ToolReply:
        session = self.manager.get(req.session_id)
        try:
            archive = await self.manager.fetch_archive(req.archive)
            result = await session.exclusive(lambda: session.unpack(archive))
        except BadArchive as exc:
            result = ToolResult(ok=False, error=f"{req.archive.uri}: {exc}")
        return _counted("overlay", result)

    async def fork(self, req: ForkRequest) -> ForkReply:
        parent = self.manager.get(req.session_id)
        if req.ttl_s <= 0:
            raise RequestError("bad_request", f"ttl_s must be positive, got {req.ttl_s}")
        children = await parent.exclusive(lambda: self.manager.fork(parent, count=req.count, ttl_s=req.ttl_s))
        return ForkReply(session_ids=[c.id for c in children], replica=self.settings.replica)

    async def limits(self, req: LimitsRequest) -> LimitsReply:
        return LimitsReply(max_fork=self.settings.max_fork, max_sessions=self.settings.max_sessions)

    async def alive(self, req: AliveRequest) -> AliveReply:
        return AliveReply(alive=req.session_id in self.manager.sessions)

    async def destroy(self, req: DestroyRequest) -> DestroyReply:
        return DestroyReply(destroyed=await self.manager.destroy(req.session_id))
