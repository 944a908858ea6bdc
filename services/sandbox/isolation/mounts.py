"""The few mount(2) calls the service makes on the host when it may (it runs as root): a size-limited
tmpfs per session, the overlay of a session's writable layer over its task snapshot, and read-only
binds of this Python for the unprivileged sandbox uid. Leftovers of a killed replica are swept by path.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MNT_DETACH = 0x2
_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def mount(source: str, target: Path, fstype: str | None, flags: int, data: str | None = None) -> None:
    rc = _libc.mount(
        source.encode(),
        os.fsencode(target),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(rc, f"mount {fstype or 'bind'} {source} on {target}")


def umount(target: Path) -> None:
    """Detach `target` (lazily: processes still using it keep it until they exit)."""
    rc = _libc.umount2(os.fsencode(target), MNT_DETACH)
    if rc != 0 and ctypes.get_errno() not in (22, 2):  # EINVAL: not a mount point; ENOENT: gone
        _check(rc, f"umount {target}")


def tmpfs(target: Path, *, size_bytes: int, inodes: int, mode: int = 0o711) -> None:
    mount(
        "tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_bytes},nr_inodes={inodes},mode={mode:o}"
    )


def overlay(*, lower: Path, upper: Path, work: Path, target: Path) -> None:
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    mount("overlay", target, "overlay", MS_NOSUID | MS_NODEV, options)


def bind_readonly(source: Path, target: Path) -> None:
    mount(str(source), target, None, MS_BIND | MS_REC)
    mount("none", target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC)


def can_mount(scratch: Path) -> bool:
    """Whether this process may mount here (root in the host's mount namespace, in practice)."""
    probe = scratch / ".mount-probe"
    probe.mkdir(parents=True, exist_ok=True)
    try:
        tmpfs(probe, size_bytes=1 << 20, inodes=16)
    except OSError:
        return False
    finally:
        umount(probe)
        probe.rmdir()
    return True


def mounted_under(root: Path) -> list[Path]:
    """Mount points at or under `root`, deepest first (the order to unmount them in)."""
    prefix = os.path.realpath(root)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(Path(point))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)
