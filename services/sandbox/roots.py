"""Workspace roots on the host: a fresh one claimed per process, the lock that says a replica under one
is alive, and taking back what a replica, or a process killed outright, left there (mounts, folders,
cgroups)."""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path

from services.sandbox.isolation import mounts
from services.sandbox.isolation.cgroups import Cgroups


class ReplicaLock:
    """An exclusive flock on `<workspace_root>/<replica>.lock`, held for as long as the replica lives.
    The kernel releases it when its process dies, however it dies, so whether a replica on this
    machine is alive is known exactly (Redis, which may be flushed, is not asked)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def try_acquire(cls, workspace_root: Path, replica: str) -> ReplicaLock | None:
        """The replica's lock, or None while a live process holds it."""
        path = workspace_root / f"{replica}.lock"
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return cls(path, fd)
            os.close(fd)  # the file was removed (its replica swept) between open and lock: take the new one

    def release(self, *, remove: bool = False) -> None:
        """Let go of the lock; `remove` deletes the file first (while it is still held)."""
        if self._fd is None:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


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
