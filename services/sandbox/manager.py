"""The sessions one replica holds: create (within `max_sessions`), fork, look up, reap, destroy.

A session lives until it is destroyed, sits idle past its TTL (every call renews it), or the replica
shuts down; its workspace, cgroup and background jobs go with it. This registry decides; the Redis
leases mirror it (`leases`), and a flush of Redis costs no session. A replica holds its `ReplicaLock`
while it lives: at start it takes the lock and sweeps what an earlier run of itself left (mounts,
folders, cgroups, leases), and its reaper sweeps what replicas whose lock nobody holds (dead ones) left
under the same workspace root (`roots` takes back the host's part); then it finds out what the host
allows (`host`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

import structlog

from crucible.bus import RequestError
from crucible.contracts.messages import ObjectRef
from crucible.objectstore import IntegrityError, ObjectNotFound
from services.sandbox import host
from services.sandbox.isolation.archive import BadArchive
from services.sandbox.isolation.bwrap import Sandbox
from services.sandbox.isolation.cgroups import Cgroups
from services.sandbox.leases import Leases, RedisError
from services.sandbox.roots import ReplicaLock, remove_replica
from services.sandbox.session import Session
from services.sandbox.settings import Settings
from services.sandbox.workspace import SnapshotCache, Workspace

Fetch = Callable[[ObjectRef], Awaitable[bytes]]
log = structlog.get_logger("crucible.sandbox")


class SessionManager:
    def __init__(self, *, settings: Settings, fetch: Fetch, leases: Leases | None = None) -> None:
        self.settings = settings
        self.fetch = fetch
        self.leases = leases
        self.workspace_root = settings.workspace_root
        self.root = settings.workspace_root / settings.replica
        self.sessions: dict[str, Session] = {}
        self.closing = False
        self._creating = 0
        self.privileged = False
        self.cgroups: Cgroups | None = None
        self.sandbox: Sandbox = None  # type: ignore[assignment]  # set by start()
        self.snapshots: SnapshotCache = None  # type: ignore[assignment]
        self.lock: ReplicaLock | None = None

    async def start(self) -> None:
        """Sweep leftovers, work out what the host allows, and check that bubblewrap works here. A start
        that fails takes back what it made (mounts, folders, cgroups) before it raises."""
        self.workspace_root.mkdir(parents=True, exist_ok=True)
        self.workspace_root.chmod(0o711)
        self.lock = await self._take_lock()
        await self.sweep(self.settings.replica)
        try:
            await self._prepare()
        except BaseException:
            await self.sweep(self.settings.replica)
            self.lock.release()
            raise

    async def _take_lock(self, *, wait_s: float = 10.0) -> ReplicaLock:
        """This replica's lock; a peer sweeping this replica's leftovers holds it for a moment."""
        deadline = time.monotonic() + wait_s
        while (lock := ReplicaLock.try_acquire(self.workspace_root, self.settings.replica)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"replica {self.settings.replica!r} is held by another live process under "
                    f"{self.workspace_root}"
                    " (give each replica its own name)"
                )
            await asyncio.sleep(0.1)
        return lock

    async def _prepare(self) -> None:
        s = self.settings
        self.root.mkdir()
        self.root.chmod(0o711)
        found = host.probe(s, self.root)
        self.privileged, self.cgroups, self.sandbox = found.privileged, found.cgroups, found.sandbox
        self.snapshots = SnapshotCache(
            self.root / "snapshots",
            sandbox=self.sandbox,
            capacity=s.snapshot_cache_size,
            max_bytes=s.max_snapshot_bytes,
            max_members=s.max_snapshot_members,
        )
        (self.root / "sessions").mkdir(mode=0o711)
        (self.root / "sessions").chmod(0o711)
        await host.check(self.sandbox, self.root)
        log.info(
            "sandbox isolation",
            overlay_and_quota=self.privileged and s.overlay_workspaces,
            host_uid=self.sandbox.host_uid,
            cgroups=("v2" if self.cgroups.v2 else "v1") if self.cgroups else None,
            session_network=self.sandbox.shared_network,
        )

    async def sweep(self, replica: str) -> None:
        """Remove everything an earlier run of `replica` left on this machine and in Redis."""
        await asyncio.to_thread(remove_replica, self.workspace_root, replica)
        if self.leases is not None:
            try:
                released = await self.leases.release_all(replica)
            except RedisError as exc:
                log.warning("cannot release leases (Redis unreachable)", replica=replica, error=str(exc))
            else:
                if released:
                    log.info("released leftover leases", replica=replica, sessions=released)

    async def sweep_dead_replicas(self) -> list[str]:
        """Sweep the folders of replicas under our workspace root whose process is gone (nobody holds
        their lock); each is swept holding its lock, so it cannot start meanwhile."""
        swept = []
        for folder in self.workspace_root.iterdir():
            name = folder.name
            if name == self.settings.replica or not folder.is_dir():
                continue
            lock = ReplicaLock.try_acquire(self.workspace_root, name)
            if lock is None:
                continue  # alive
            try:
                await self.sweep(name)
            finally:
                lock.release(remove=True)
            swept.append(name)
        return swept

    def _room(self, wanted: int) -> None:
        if self.closing:
            raise RequestError("shutting_down", "this replica is shutting down; retry")
        if len(self.sessions) + self._creating + wanted > self.settings.max_sessions:
            raise RequestError(
                "busy", f"this replica holds {self.settings.max_sessions} sessions; retry later"
            )

    async def create(self, *, run_id: str, task_id: str, snapshot: ObjectRef, ttl_s: float) -> Session:
        if ttl_s <= 0:
            raise RequestError("bad_request", f"ttl_s must be positive, got {ttl_s}")
        self._room(1)
        self._creating += 1
        try:
            try:
                snap = await self.snapshots.acquire(snapshot.sha256, lambda: self.fetch_archive(snapshot))
            except BadArchive as exc:
                raise RequestError("bad_snapshot", f"{snapshot.uri}: {exc}") from exc
            try:
                session = await self._new_session(run_id=run_id, task_id=task_id, snap=snap, ttl_s=ttl_s)
            except BaseException:
                self.snapshots.release(snap)
                raise
        finally:
            self._creating -= 1
        return await self._register(session)

    async def fork(self, parent: Session, *, count: int, ttl_s: float) -> list[Session]:
        """`count` copies of `parent`'s workspace as it is now (call under the parent's lock)."""
        if not 1 <= count <= self.settings.max_fork:
            raise RequestError("bad_request", f"count must be 1..{self.settings.max_fork}, got {count}")
        if any(job.running for job in parent.jobs.values()):
            # The copy runs on the host and opens what it copies by path: a running job could swap a
            # folder for a symlink mid-copy and have a host file copied into the fork.
            raise RequestError("busy", "the session runs background jobs; kill them before forking it")
        self._room(count)
        self._creating += count
        children: list[Session] = []
        try:
            for _ in range(count):
                snap = await self.snapshots.acquire(parent.workspace.snapshot.key, _never)
                try:
                    child = await self._new_session(
                        run_id=parent.run_id, task_id=parent.task_id, snap=snap, ttl_s=ttl_s, parent=parent
                    )
                except BaseException:
                    self.snapshots.release(snap)
                    raise
                children.append(child)
        except BaseException:
            for child in children:
                await self._dispose(child)
            raise
        finally:
            self._creating -= count
        return [await self._register(child) for child in children]

    async def _new_session(self, *, run_id, task_id, snap, ttl_s, parent: Session | None = None) -> Session:
        s = self.settings
        session_id = uuid.uuid4().hex
        workspace = await Workspace.create(
            self.root / "sessions" / session_id,
            snap,
            overlay=self.privileged and s.overlay_workspaces,
            sandbox=self.sandbox,
            quota_bytes=s.disk_quota_bytes,
            quota_inodes=s.disk_quota_inodes,
            parent=parent.workspace if parent else None,
        )
        try:
            cgroup = self.cgroups.create(session_id) if self.cgroups else None
        except OSError:
            await asyncio.to_thread(workspace.destroy)
            raise
        return Session(
            session_id=session_id,
            run_id=run_id,
            task_id=task_id,
            workspace=workspace,
            cgroup=cgroup,
            ttl_s=min(ttl_s, s.max_ttl_s),
            settings=s,
            sandbox=self.sandbox,
        )

    async def _register(self, session: Session) -> Session:
        if self.closing:
            await self._dispose(session)
            raise RequestError("shutting_down", "this replica is shutting down; retry")
        self.sessions[session.id] = session
        if self.leases is not None:
            try:
                await self.leases.grant(session.id, session.ttl_s)
            except RedisError as exc:
                log.warning("no lease (Redis unreachable); the local TTL applies", error=str(exc))
        log.debug("session created", session_id=session.id, run_id=session.run_id, task_id=session.task_id)
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
        if self.leases is not None:
            self.leases.renew(session_id, session.ttl_s)
        return session

    async def _dispose(self, session: Session) -> None:
        await session.destroy()
        self.snapshots.release(session.workspace.snapshot)

    async def destroy(self, session_id: str) -> bool:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        await self._dispose(session)
        if self.leases is not None:
            try:
                await self.leases.drop(session_id)
            except RedisError as exc:
                log.warning("cannot drop a lease (Redis unreachable)", error=str(exc))
        log.debug("session destroyed", session_id=session_id)
        return True

    async def reap(self) -> int:
        """Destroy the idle sessions whose TTL passed since their last call, and put back the leases of
        the others that Redis lost (a flush, a failover): Redis mirrors this registry, never rules it."""
        now = time.monotonic()
        expired = [s.id for s in self.sessions.values() if not s.busy and s.deadline < now]
        if self.leases is not None:
            live = {sid: s.deadline - now for sid, s in self.sessions.items() if sid not in expired}
            try:
                restored = await self.leases.restore(live)
            except RedisError as exc:
                log.warning("cannot mirror leases (Redis unreachable)", error=str(exc))
            else:
                if restored:
                    log.warning("re-established leases Redis had lost", sessions=len(restored))
        for session_id in expired:
            if session_id in self.sessions and not self.sessions[session_id].busy:
                await self.destroy(session_id)
        return len(expired)

    async def reap_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.reap()
                await self.sweep_dead_replicas()
            except Exception:  # the reaper must outlive any one failure
                log.exception("reaper failed; retrying")
            try:
                await asyncio.wait_for(stop.wait(), self.settings.reap_interval_s)
            except TimeoutError:
                pass

    async def close(self) -> None:
        """Destroy every session and this replica's folder, mounts and cgroups (shutdown)."""
        self.closing = True
        await asyncio.gather(*(self.destroy(session_id) for session_id in list(self.sessions)))
        await self.sweep(self.settings.replica)
        if self.lock is not None:
            self.lock.release(remove=True)


async def _never() -> bytes:
    raise BadArchive("the parent's snapshot is no longer cached")
