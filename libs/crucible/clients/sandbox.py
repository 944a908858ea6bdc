"""Client of the sandbox service: create a session, call its tools, export its diff, destroy it.

    async with await SandboxClient(bus).create(run_id=..., task_id=..., snapshot=ref) as box:
        result = await box.tool("read_file", path="setup.py")
        copies = await box.fork(8)  # the G rollouts of a group, from one prepared workspace
        diff = await box.diff()

Errors from the service raise `crucible.bus.RemoteError` with a code (`unknown_session`, `busy`,
`bad_snapshot`, ...); a failed tool call is not an error but a `ToolResult` with ok=False. While a call
runs longer than `PROBE_EVERY_S`, the client asks the replica every `PROBE_EVERY_S` whether it still
holds the session: if it died (or restarted without it) the call raises `SandboxLost` within seconds
instead of waiting out its deadline (which covers the command's own timeout, minutes for a test run).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType
from typing import TypeVar

from crucible.bus import Bus, BusError, BusTimeout, BusUnavailable
from crucible.contracts import endpoints
from crucible.contracts.endpoints import SessionEndpoint
from crucible.contracts.messages import Message, ObjectRef
from crucible.contracts.sandbox import (
    AliveRequest,
    ApplyRequest,
    CreateRequest,
    DestroyRequest,
    DiffRequest,
    ForkRequest,
    OverlayRequest,
    RunRequest,
    ToolRequest,
    ToolResult,
)

REPLY_MARGIN_S = 15.0
PROBE_EVERY_S = 5.0
PROBE_MISSES = 2
"""Probes in a row the replica must fail to answer before its session is taken for lost."""
Q = TypeVar("Q", bound=Message)
R = TypeVar("R", bound=Message)


class SandboxLost(BusUnavailable):
    """The session's replica died, or restarted without the session: the call will never be answered."""


class SandboxSession:
    """One session on the replica that holds it. Calls on one session run one at a time."""

    def __init__(self, bus: Bus, *, session_id: str, replica: str, call_timeout_s: float) -> None:
        self.bus = bus
        self.session_id = session_id
        self.replica = replica
        self.call_timeout_s = call_timeout_s

    def _deadline(self, command_timeout_s: float | None) -> float:
        return max(self.call_timeout_s, (command_timeout_s or 0.0) + REPLY_MARGIN_S)

    async def _ask(self, endpoint: SessionEndpoint[Q, R], request: Q, *, timeout: float | None = None) -> R:
        """One call on the session, given up with `SandboxLost` once the replica stops holding it."""
        call = asyncio.ensure_future(
            self.bus.request(endpoint.on(self.replica), request, timeout=timeout or self.call_timeout_s)
        )
        misses = 0
        try:
            while not (await asyncio.wait({call}, timeout=PROBE_EVERY_S))[0]:
                try:
                    alive = await self.bus.request(
                        endpoints.SANDBOX_ALIVE.on(self.replica), AliveRequest(session_id=self.session_id),
                        timeout=PROBE_EVERY_S,
                    )  # fmt: skip
                except BusTimeout:
                    misses += 1
                    if misses < PROBE_MISSES:
                        continue
                    raise SandboxLost(
                        f"sandbox replica {self.replica} stopped answering (session {self.session_id})"
                    ) from None
                misses = 0
                if not alive.alive:
                    raise SandboxLost(
                        f"sandbox replica {self.replica} no longer holds session {self.session_id}"
                    )
            return call.result()
        finally:
            call.cancel()

    async def tool(self, name: str, /, **arguments: object) -> ToolResult:
        request = ToolRequest(session_id=self.session_id, name=name, arguments=arguments)
        timeout_s = arguments.get("timeout_s")
        deadline = self._deadline(float(timeout_s) if isinstance(timeout_s, int | float) else None)
        reply = await self._ask(endpoints.SANDBOX_TOOL, request, timeout=deadline)
        return reply.result

    async def diff(self) -> str:
        request = DiffRequest(session_id=self.session_id)
        reply = await self._ask(endpoints.SANDBOX_DIFF, request)
        return reply.diff

    async def apply_patch(self, patch: str) -> ToolResult:
        request = ApplyRequest(session_id=self.session_id, patch=patch)
        reply = await self._ask(endpoints.SANDBOX_APPLY, request)
        return reply.result

    async def run(
        self, command: str | Sequence[str], *, timeout_s: float, output_cap: int | None = None
    ) -> ToolResult:
        """Run a shell command (str) or an argv (sequence) in the sandbox."""
        shell = isinstance(command, str)
        request = RunRequest(
            session_id=self.session_id,
            command=command if shell else None,
            argv=None if shell else list(command),
            timeout_s=timeout_s,
            output_cap=output_cap,
        )
        reply = await self._ask(endpoints.SANDBOX_RUN, request, timeout=self._deadline(timeout_s))
        return reply.result

    async def overlay(self, archive: ObjectRef) -> ToolResult:
        """Lay a tar.gz from the object store over the workspace root."""
        request = OverlayRequest(session_id=self.session_id, archive=archive)
        reply = await self._ask(endpoints.SANDBOX_OVERLAY, request)
        return reply.result

    async def fork(self, count: int, *, ttl_s: float = 600.0) -> list[SandboxSession]:
        """`count` copies of this session's workspace as it is now, on the same replica (copy-on-write)."""
        request = ForkRequest(session_id=self.session_id, count=count, ttl_s=ttl_s)
        reply = await self._ask(endpoints.SANDBOX_FORK, request)
        return [
            SandboxSession(
                self.bus, session_id=sid, replica=reply.replica, call_timeout_s=self.call_timeout_s
            )
            for sid in reply.session_ids
        ]

    async def destroy(self) -> bool:
        """Destroy the session; False if it was already gone."""
        request = DestroyRequest(session_id=self.session_id)
        reply = await self._ask(endpoints.SANDBOX_DESTROY, request)
        return reply.destroyed

    async def __aenter__(self) -> SandboxSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.destroy()
        except BusError:
            if exc is None:
                raise  # otherwise the session expires on its own; keep the original error


class SandboxClient:
    def __init__(self, bus: Bus, *, create_timeout_s: float = 120.0, call_timeout_s: float = 120.0) -> None:
        self.bus = bus
        self.create_timeout_s = create_timeout_s
        self.call_timeout_s = call_timeout_s

    async def create(
        self, *, run_id: str, task_id: str, snapshot: ObjectRef, ttl_s: float = 600.0
    ) -> SandboxSession:
        request = CreateRequest(run_id=run_id, task_id=task_id, snapshot=snapshot, ttl_s=ttl_s)
        reply = await self.bus.request(endpoints.SANDBOX_CREATE, request, timeout=self.create_timeout_s)
        return SandboxSession(
            self.bus, session_id=reply.session_id, replica=reply.replica, call_timeout_s=self.call_timeout_s
        )
