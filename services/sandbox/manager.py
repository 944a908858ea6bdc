"""The sessions one replica holds: create (within `max_sessions`), fork, look up, reap, destroy.

A session lives until it is destroyed, its lease lapses (every call renews it), or the replica shuts
down; its workspace, cgroup and background jobs go with it. At start a replica sweeps what an earlier
run of itself left (mounts, folders, cgroups, leases) and what replicas with a lapsed heartbeat left
under the same workspace root.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from crucible import pytest_report
from crucible.bus import RequestError
from crucible.contracts.messages import ObjectRef
from crucible.objectstore import IntegrityError, ObjectNotFound
from services.sandbox import mounts, network
from services.sandbox.archive import BadArchive
from services.sandbox.bwrap import (
    PLUGIN_DIR,
    Bind,
    Limits,
    Sandbox,
    bwrap_supports,
    python_paths,
    write_etc,
)
from services.sandbox.cgroups import Cgroups
from services.sandbox.leases import Leases, RedisError
from services.sandbox.session import Session
from services.sandbox.settings import Settings
from services.sandbox.workspace import SnapshotCache, Workspace

Fetch = Callable[[ObjectRef], Awaitable[bytes]]
log = structlog.get_logger("crucible.sandbox")


def remove_replica(workspace_root: Path, replica: str) -> None:
    """Unmount, delete and un-cgroup what `replica` left under `workspace_root` on this machine."""
    folder = workspace_root / replica
    for point in mounts.mounted_under(folder) if folder.exists() else []:
        mounts.umount(point)
    shutil.rmtree(folder, ignore_errors=True)
    if os.geteuid() == 0:
        Cgroups.sweep_replica(replica)


def claim_workspace_root(parent: Path, prefix: str) -> Path:
    """A fresh workspace root, `parent/<prefix><pid namespace>.<pid>-<random>` (0711): it names this
    process, so that `sweep_abandoned_roots` can tell once nobody holds it."""
    root = Path(tempfile.mkdtemp(prefix=f"{prefix}{_pid_namespace()}.{os.getpid()}-", dir=parent))
    root.chmod(0o711)
    return root


def sweep_abandoned_roots(parent: Path, prefix: str) -> list[Path]:
    """Take back the workspace roots of `claim_workspace_root` whose process is gone without cleaning
    up (killed outright): every replica's mounts, cgroups and folders. Only this user's roots, made
    in this pid namespace (a process of another one, e.g. a container sharing /tmp, is not visible
    here). Cgroups are found under this process's own cgroup: a root left by a process that lived in
    another (another systemd scope) loses its mounts and folders, its cgroups stay."""
    swept = []
    for root in parent.glob(f"{prefix}*"):
        namespace, _, pid = root.name.removeprefix(prefix).split("-", 1)[0].partition(".")
        try:
            info = root.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
                continue  # not a root this user's processes made
            if namespace != _pid_namespace() or not (pid.isascii() and pid.isdigit()) or _alive(int(pid)):
                continue
            for replica in [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()]:
                remove_replica(root, replica.name)
        except OSError:
            continue  # gone meanwhile, or another process is sweeping it now
        shutil.rmtree(root, ignore_errors=True)
        swept.append(root)
    return swept


def _pid_namespace() -> str:
    return str(os.stat("/proc/self/ns/pid").st_ino)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process; or not a pid of this system: leave it be
    return True


def _searchable_by_others(path: Path) -> bool:
    """Whether a process of another uid can reach `path` (every folder above it has o+x)."""
    for folder in [path, *path.parents]:
        if folder.exists() and not os.stat(folder).st_mode & 0o001:
            return False
    return True


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

    async def start(self) -> None:
        """Sweep leftovers, work out what the host allows, and check that bubblewrap works here. A start
        that fails takes back what it made (mounts, folders, cgroups) before it raises."""
        self.workspace_root.mkdir(parents=True, exist_ok=True)
        self.workspace_root.chmod(0o711)
        await self.sweep(self.settings.replica)
        try:
            await self._prepare()
        except BaseException:
            await self.sweep(self.settings.replica)
            raise

    async def _prepare(self) -> None:
        s = self.settings
        self.root.mkdir()
        self.root.chmod(0o711)
        self.privileged = os.geteuid() == 0 and mounts.can_mount(self.root)
        host_uid = s.sandbox_uid if os.geteuid() == 0 else None
        if host_uid is not None and not _searchable_by_others(self.root):
            raise RuntimeError(
                f"workspace_root {self.workspace_root} is not reachable by the sandbox uid {host_uid}: "
                "every folder above it needs o+x"
            )
        ro_binds = []
        for i, path in enumerate([*python_paths(), *s.extra_ro_paths]):
            if host_uid is not None and self.privileged and not _searchable_by_others(path):
                view = self.root / "ro" / str(i)
                view.mkdir(parents=True)
                mounts.bind_readonly(path, view)  # reachable by the sandbox uid, still read-only
                ro_binds.append(Bind(source=view, dest=str(path)))
            else:
                ro_binds.append(Bind(source=path, dest=str(path)))
        ro_binds.append(Bind(source=pytest_report.install(self.root / "plugins").parent, dest=PLUGIN_DIR))
        self.cgroups = (
            Cgroups.detect(
                replica=s.replica, memory_bytes=s.memory_bytes, max_processes=s.max_processes, cpus=s.cpus
            )
            if os.geteuid() == 0
            else None
        )
        limits = Limits(
            memory_bytes=s.memory_bytes,
            # Without per-session cgroups, the rlimit is the only count limit (and counts per uid).
            max_processes=s.max_processes_per_uid if self.cgroups else s.max_processes,
            max_write_bytes=s.max_write_bytes,
            cpu_seconds=s.cpu_seconds,
            open_files=s.open_files,
        )
        self.sandbox = Sandbox(
            limits=limits,
            etc_dir=write_etc(self.root / "etc"),
            ro_binds=ro_binds,
            host_uid=host_uid,
            disable_userns=bwrap_supports("--disable-userns"),
            tmp_bytes=s.disk_quota_bytes,
            shared_network=network.can_share_network(),
        )
        self.snapshots = SnapshotCache(
            self.root / "snapshots",
            sandbox=self.sandbox,
            capacity=s.snapshot_cache_size,
            max_bytes=s.max_snapshot_bytes,
            max_members=s.max_snapshot_members,
        )
        (self.root / "sessions").mkdir(mode=0o711)
        (self.root / "sessions").chmod(0o711)
        await self.check()
        log.info(
            "sandbox isolation",
            overlay_and_quota=self.privileged and s.overlay_workspaces,
            host_uid=host_uid,
            cgroups=("v2" if self.cgroups.v2 else "v1") if self.cgroups else None,
            session_network=self.sandbox.shared_network,
        )

    async def check(self) -> None:
        """Fail fast if bubblewrap cannot create its namespaces on this machine, or (where sessions
        get a network of their own) cannot run a command in one."""
        probe = self.root / "probe"
        probe.mkdir(exist_ok=True)
        netns = network.loopback_namespace() if self.sandbox.shared_network else None
        try:
            for joined in [None, netns] if netns is not None else [None]:
                result = await self.sandbox.run(["true"], workspace=probe, timeout_s=30.0, netns=joined)
                if not result.ok:
                    where = " in a session's network" if joined is not None else ""
                    raise RuntimeError(
                        f"bubblewrap does not work here{where} ({result.error}): {result.output.strip()}"
                    )
        finally:
            if netns is not None:
                os.close(netns)
            probe.rmdir()

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
        """Sweep the folders of replicas under our workspace root whose heartbeat lapsed."""
        if self.leases is None:
            return []
        swept = []
        for folder in self.workspace_root.iterdir():
            name = folder.name
            if name == self.settings.replica or not folder.is_dir():
                continue
            try:
                if await self.leases.alive(name):
                    continue
            except RedisError:
                return swept
            await self.sweep(name)
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
        """Destroy the sessions whose lease lapsed (or, without Redis, that sat idle past their TTL)."""
        now = time.monotonic()
        idle = [s.id for s in self.sessions.values() if not s.busy]
        expired = [sid for sid in idle if self.sessions[sid].deadline < now]
        if self.leases is not None:
            try:
                await self.leases.heartbeat(3 * self.settings.reap_interval_s)
                expired = await self.leases.lapsed(idle)
            except RedisError as exc:
                log.warning("cannot check leases (Redis unreachable); the local TTL applies", error=str(exc))
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


async def _never() -> bytes:
    raise BadArchive("the parent's snapshot is no longer cached")
