"""The sessions one replica holds: create (within `max_sessions`), look up, expire, destroy.

A session lives until it is destroyed, stays idle past its TTL (every call renews it), or the replica
shuts down; its workspace folder goes with it.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable

import structlog

from crucible.bus import RequestError
from crucible.contracts.messages import ObjectRef
from crucible.objectstore import IntegrityError, ObjectNotFound
from services.sandbox.archive import BadArchive
from services.sandbox.bwrap import Limits, Sandbox, bwrap_supports, python_paths, write_etc
from services.sandbox.process import execute
from services.sandbox.session import Session
from services.sandbox.settings import Settings

Fetch = Callable[[ObjectRef], Awaitable[bytes]]
log = structlog.get_logger("crucible.sandbox")


def build_sandbox(settings: Settings) -> Sandbox:
    limits = Limits(
        memory_bytes=settings.memory_bytes,
        max_processes=settings.max_processes,
        max_write_bytes=settings.max_write_bytes,
        cpu_seconds=settings.cpu_seconds,
        open_files=settings.open_files,
    )
    etc_dir = write_etc(settings.workspace_root / settings.replica / ".etc")
    return Sandbox(
        limits=limits,
        etc_dir=etc_dir,
        ro_paths=[*python_paths(), *settings.extra_ro_paths],
        disable_userns=bwrap_supports("--disable-userns"),
    )


class SessionManager:
    def __init__(self, *, settings: Settings, fetch: Fetch, sandbox: Sandbox | None = None) -> None:
        self.settings = settings
        self.fetch = fetch
        self.root = settings.workspace_root / settings.replica
        self.root.mkdir(parents=True, exist_ok=True)
        self.sandbox = sandbox or build_sandbox(settings)
        self.sessions: dict[str, Session] = {}
        self.closing = False
        self._creating = 0

    async def create(self, *, run_id: str, task_id: str, snapshot: ObjectRef, ttl_s: float) -> Session:
        if self.closing:
            raise RequestError("shutting_down", "this replica is shutting down; retry")
        if ttl_s <= 0:
            raise RequestError("bad_request", f"ttl_s must be positive, got {ttl_s}")
        if len(self.sessions) + self._creating >= self.settings.max_sessions:
            raise RequestError(
                "busy", f"this replica holds {self.settings.max_sessions} sessions; retry later"
            )
        self._creating += 1
        try:
            archive = await self.fetch_archive(snapshot)
            session_id = uuid.uuid4().hex
            session = await Session.create(
                archive=archive,
                session_id=session_id,
                run_id=run_id,
                task_id=task_id,
                root=self.root / session_id,
                ttl_s=min(ttl_s, self.settings.max_ttl_s),
                settings=self.settings,
                sandbox=self.sandbox,
            )
        except BadArchive as exc:
            raise RequestError("bad_snapshot", f"{snapshot.uri}: {exc}") from exc
        finally:
            self._creating -= 1
        if self.closing:
            await session.destroy()
            raise RequestError("shutting_down", "this replica is shutting down; retry")
        self.sessions[session.id] = session
        log.info("session created", session_id=session.id, run_id=run_id, task_id=task_id)
        return session

    async def fetch_archive(self, ref: ObjectRef) -> bytes:
        try:
            return await self.fetch(ref)
        except (ObjectNotFound, IntegrityError) as exc:
            raise BadArchive(f"cannot fetch: {type(exc).__name__}: {exc}") from exc

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise RequestError(
                "unknown_session", f"no session {session_id!r} on this replica (destroyed or expired?)"
            )
        return session

    async def destroy(self, session_id: str) -> bool:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        await session.destroy()
        log.info("session destroyed", session_id=session_id)
        return True

    async def reap(self) -> int:
        """Destroy the sessions idle past their TTL; return how many."""
        now = time.monotonic()
        expired = [s.id for s in self.sessions.values() if s.deadline < now and not s.busy]
        for session_id in expired:
            await self.destroy(session_id)
        return len(expired)

    async def reap_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.reap()
            try:
                await asyncio.wait_for(stop.wait(), self.settings.reap_interval_s)
            except TimeoutError:
                pass

    async def close(self) -> None:
        """Destroy every session and this replica's folder (shutdown)."""
        self.closing = True
        await asyncio.gather(*(self.destroy(session_id) for session_id in list(self.sessions)))
        await asyncio.to_thread(shutil.rmtree, self.root, ignore_errors=True)

    async def check(self) -> None:
        """Fail fast if bubblewrap cannot create its namespaces on this machine."""
        probe = self.root / ".probe"
        probe.mkdir(exist_ok=True)
        argv = self.sandbox.argv(["true"], workspace=probe)
        result = await execute(argv, timeout_s=30.0, output_cap=4096)
        if not result.ok:
            raise RuntimeError(f"bubblewrap does not work here ({result.error}): {result.output.strip()}")
