"""Workspace roots on the host: a fresh one claimed per process, and taking back what a replica, or a
process killed outright, left under one (mounts, folders, cgroups)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from services.sandbox.isolation import mounts
from services.sandbox.isolation.cgroups import Cgroups


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
