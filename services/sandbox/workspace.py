"""Workspaces: a task snapshot unpacked once per replica, and per session a writable layer over it.

A snapshot (tar.gz in the object store) is unpacked inside a sandbox into `snapshots/<sha256>/tree`
and committed to a baseline git repository beside it, once; every session of that task then shares
it read-only. Where the service may mount (root), a session's workspace is an overlay: the snapshot is
the lower layer, the agent's work is exactly the upper layer, and both upper layer and overlay
bookkeeping live on a tmpfs of the session's disk quota. Creating one is a few mount calls; forking
one copies only its upper layer. Where the service may not mount, a session gets a full copy of the
snapshot instead (`cp --reflink=auto`, so copy-on-write where the filesystem can) and the quota is not
enforced: only the per-file size limit applies.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.sandbox.isolation import mounts
from services.sandbox.isolation.archive import BadArchive, check_archive
from services.sandbox.isolation.bwrap import WORKSPACE, Bind, Sandbox
from services.sandbox.isolation.process import execute

GIT_DIR = "/crucible/baseline.git"
STATE_DIR = "/crucible/state"
PREPARE_TIMEOUT_S = 120.0
UNTAR = ["tar", "-xzf", "-", "--no-same-owner", "--no-same-permissions", "-C", WORKSPACE]
_COMMIT = "git -c user.name=crucible -c user.email=crucible@localhost commit -q --no-verify --allow-empty"
_IGNORED = "'__pycache__/' '*.pyc' '.pytest_cache/'"
BASELINE = (
    f"set -e; git init -q; printf '%s\\n' {_IGNORED} > \"$GIT_DIR/info/exclude\"; "
    f"git add -A -f; {_COMMIT} -m snapshot"
)


def git_env() -> dict[str, str]:
    """Git over a session: the snapshot's repository read-only, the session's index and new objects
    in its own state folder."""
    return {
        "GIT_DIR": GIT_DIR,
        "GIT_WORK_TREE": WORKSPACE,
        "GIT_INDEX_FILE": f"{STATE_DIR}/index",
        "GIT_OBJECT_DIRECTORY": f"{STATE_DIR}/objects",
        "GIT_ALTERNATE_OBJECT_DIRECTORIES": f"{GIT_DIR}/objects",
    }


GIT_PREPARE = (
    '[ -f "$GIT_INDEX_FILE" ] || cp "$GIT_DIR/index" "$GIT_INDEX_FILE"; mkdir -p "$GIT_OBJECT_DIRECTORY"'
)


@dataclass
class Snapshot:
    key: str
    tree: Path
    git_dir: Path
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)


class SnapshotCache:
    """The snapshots this replica has unpacked, shared by their sessions; the least recently used
    ones nobody holds are deleted beyond `capacity`."""

    def __init__(
        self, root: Path, *, sandbox: Sandbox, capacity: int, max_bytes: int, max_members: int
    ) -> None:
        self.root = root
        self.sandbox = sandbox
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.max_members = max_members
        self.ready: dict[str, Snapshot] = {}
        self._preparing: dict[str, asyncio.Future[Snapshot]] = {}
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o711)

    async def acquire(self, key: str, fetch: Callable[[], Awaitable[bytes]]) -> Snapshot:
        """The snapshot `key` (its sha256), unpacked on first use from `await fetch()`; held until
        `release`. BadArchive if the archive is refused or does not unpack."""
        snapshot = self.ready.get(key)
        if snapshot is None:
            pending = self._preparing.get(key)
            if pending is None:
                pending = asyncio.ensure_future(self._prepare(key, fetch))
                self._preparing[key] = pending
                pending.add_done_callback(lambda _: self._preparing.pop(key, None))
            snapshot = await asyncio.shield(pending)
        snapshot.users += 1
        snapshot.last_used = time.monotonic()
        return snapshot

    def release(self, snapshot: Snapshot) -> None:
        snapshot.users -= 1
        snapshot.last_used = time.monotonic()
        idle = sorted((s for s in self.ready.values() if s.users == 0), key=lambda s: s.last_used)
        for victim in idle[: max(0, len(self.ready) - self.capacity)]:
            del self.ready[victim.key]
            shutil.rmtree(self.root / victim.key, ignore_errors=True)

    async def _prepare(self, key: str, fetch: Callable[[], Awaitable[bytes]]) -> Snapshot:
        archive = await fetch()
        await asyncio.to_thread(
            check_archive, archive, max_bytes=self.max_bytes, max_members=self.max_members
        )
        part = self.root / f"{key}.part-{uuid.uuid4().hex[:8]}"
        tree, git_dir = part / "tree", part / "baseline.git"
        try:
            for d in (part, tree, git_dir):
                d.mkdir()
                if self.sandbox.owner is not None:
                    os.chown(d, *self.sandbox.owner)
            part.chmod(0o711)
            result = await self.sandbox.run(UNTAR, workspace=tree, stdin=archive, timeout_s=PREPARE_TIMEOUT_S)
            if not result.ok:
                raise BadArchive(f"cannot unpack: {result.error}: {result.output.strip()}")
            env = {"GIT_DIR": GIT_DIR, "GIT_WORK_TREE": WORKSPACE}
            binds = [Bind(source=git_dir, dest=GIT_DIR, writable=True)]
            result = await self.sandbox.run(
                ["bash", "-c", BASELINE], workspace=tree, binds=binds, env=env, timeout_s=PREPARE_TIMEOUT_S
            )
            if not result.ok:
                raise RuntimeError(f"cannot commit the snapshot: {result.error}: {result.output}")
            final = self.root / key
            shutil.rmtree(final, ignore_errors=True)
            part.rename(final)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, part, ignore_errors=True)
            raise
        snapshot = Snapshot(key=key, tree=final / "tree", git_dir=final / "baseline.git")
        self.ready[key] = snapshot
        return snapshot


class Workspace:
    """One session's files: `path` is what the sandbox sees at /workspace; `state` holds its git index."""

    def __init__(self, root: Path, snapshot: Snapshot, *, overlay: bool, sandbox: Sandbox) -> None:
        self.root = root
        self.snapshot = snapshot
        self.overlay = overlay
        self.sandbox = sandbox
        self.path = root / "merged"
        self.upper = root / "upper"
        self.state = root / "state"

    @classmethod
    async def create(
        cls,
        root: Path,
        snapshot: Snapshot,
        *,
        overlay: bool,
        sandbox: Sandbox,
        quota_bytes: int,
        quota_inodes: int,
        parent: Workspace | None = None,
    ) -> Workspace:
        """A new workspace over `snapshot`, or a copy of `parent`'s (its files as they are now)."""
        ws = cls(root, snapshot, overlay=overlay, sandbox=sandbox)
        try:
            root.mkdir(mode=0o711)
            if overlay:
                mounts.tmpfs(root, size_bytes=quota_bytes, inodes=quota_inodes)
                for d in (ws.upper, root / "work", ws.path, ws.state):
                    d.mkdir()
                if parent is not None:
                    await _copy_tree(parent.upper, ws.upper)
                ws._own(ws.upper, ws.state)
                mounts.overlay(lower=snapshot.tree, upper=ws.upper, work=root / "work", target=ws.path)
            else:
                ws.state.mkdir()
                await _copy_tree((parent.path if parent else snapshot.tree), ws.path)
                ws._own(ws.path, ws.state)
        except BaseException:
            await asyncio.to_thread(ws.destroy)
            raise
        return ws

    def _own(self, *paths: Path) -> None:
        for path in paths:
            path.chmod(0o755)
            if self.sandbox.owner is not None:
                os.chown(path, *self.sandbox.owner)

    def free_bytes(self) -> int | None:
        """Room left under the quota (None where there is no quota)."""
        if not self.overlay:
            return None
        st = os.statvfs(self.root)
        return 0 if st.f_favail == 0 else st.f_bavail * st.f_frsize

    def git_binds(self) -> list[Bind]:
        return [
            Bind(source=self.snapshot.git_dir, dest=GIT_DIR),
            Bind(source=self.state, dest=STATE_DIR, writable=True),
        ]

    def destroy(self) -> None:
        """Unmount and delete (idempotent)."""
        if self.overlay:
            mounts.umount(self.path)
            mounts.umount(self.root)
        shutil.rmtree(self.root, ignore_errors=True)


async def _copy_tree(source: Path, dest: Path) -> None:
    """cp -a: links stay links, special files stay special (overlay whiteouts too), nothing is followed."""
    argv = ["cp", "-a", "--reflink=auto", "--no-target-directory", str(source), str(dest)]
    result = await execute(argv, timeout_s=PREPARE_TIMEOUT_S, output_cap=4096)
    if not result.ok:
        raise RuntimeError(f"cannot copy a workspace: {result.error}: {result.output.strip()}")
