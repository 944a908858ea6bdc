"""Helpers of the sandbox abuse suite: the task every attack starts from, scripts run inside, and
what the host looks like (processes, mounts, folders, cgroups) before and after."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.sandbox.isolation.cgroups import CGROUP_PREFIX, replica_cgroup
from services.sandbox.settings import Settings

REPO = {
    "calc/__init__.py": "",
    "calc/ops.py": "def add(a, b):\n    return a + b\n",
    "tests/test_ops.py": "from calc.ops import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
}
REFUSED = (
    "outside the workspace",
    "must be under /workspace",
    "not a usable path",
    "not allowed in a new path",
    "not a regular file",
    "names no file",
)
"""What the file tools answer for a path that would leave the workspace."""

SWAP_FOREVER = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b = sys.argv[1].encode(), sys.argv[2].encode()
while True:
    libc.renameat2(-100, a, -100, b, 2)  # RENAME_EXCHANGE: the two names trade places atomically
"""
"""Swap a folder and a symlink for ever, so a host-side walk meets the link where it saw a folder."""


def refused(error: str | None) -> bool:
    return bool(error) and any(reason in error for reason in REFUSED)


def fingerprint(path: Path) -> tuple[bytes, int]:
    """A host file's content and modification time, to show an attack left it alone."""
    return path.read_bytes(), path.stat().st_mtime_ns


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _uid(pid: str) -> int | None:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


def pids() -> list[str]:
    return [name for name in os.listdir("/proc") if name.isdigit()]


def cmdline(pid: str | int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace("\0", " ")


def with_marker(marker: str) -> dict[int, str]:
    """Host processes whose command line holds `marker`, and their command lines."""
    found = {}
    for pid in pids():
        line = cmdline(pid)
        if marker in line and int(pid) != os.getpid():
            found[int(pid)] = line
    return found


def uids(found: dict[int, str]) -> set[int | None]:
    return {_uid(str(pid)) for pid in found}


def sandbox_uid(settings: Settings) -> int:
    """The host uid sandboxed commands run as: the sandbox uid when the service runs as root."""
    return settings.sandbox_uid if os.geteuid() == 0 else os.getuid()


def service_processes(settings: Settings, needle: str | None = None) -> set[int]:
    """Host processes of this service's sandboxes (of one session, given its id as `needle`): the
    sandbox uid, and bubblewrap's command line or the process's mount table names the workspace root
    (every sandbox binds files from it) or the session. A process whose cgroup is another replica's is
    another service's, whatever its mount table shows (the bubblewrap of a service beside this one, e.g.
    on another pytest worker, stays in the host's mount namespace, whose table lists every mount)."""
    needle = needle or str(settings.workspace_root)
    uid = sandbox_uid(settings)
    found = set()
    for pid in pids():
        if _uid(pid) != uid:
            continue
        groups = _read(f"/proc/{pid}/cgroup")
        if f"/{CGROUP_PREFIX}" in groups and f"/{replica_cgroup(settings.replica)}" not in groups:
            continue
        if needle in cmdline(pid) or needle in _read(f"/proc/{pid}/mountinfo"):
            found.add(int(pid))
    return found


def lasting_processes(settings: Settings, *, within_s: float = 5.0) -> dict[int, str]:
    """`service_processes` that are still there after up to `within_s` of polling, with their command
    lines and cgroups: what a leak looks like. A process of a sandbox beside this one (another pytest
    worker's, between its start and joining its cgroup or leaving the host's mount table) can match
    for an instant (seen once in CI, its cause unproven); a leaked daemon stays."""
    deadline = time.monotonic() + within_s
    while (found := service_processes(settings)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {pid: f"{cmdline(pid)!r} cgroup {_read(f'/proc/{pid}/cgroup').split()!r}" for pid in found}


def children() -> set[int]:
    """Processes whose parent is this test process (zombies too)."""
    me = str(os.getpid())
    found = set()
    for pid in pids():
        fields = _read(f"/proc/{pid}/stat").rpartition(")")[2].split()
        if len(fields) > 1 and fields[1] == me:
            found.add(int(pid))
    return found


def mounts_under(root: Path) -> list[str]:
    prefix = os.path.realpath(root)
    points = []
    for line in _read("/proc/self/mountinfo").splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(points)


def cgroup_dirs(replica: str) -> list[str]:
    """Folders of this replica's cgroups (its parent and one per session), in every hierarchy."""
    name = replica_cgroup(replica)
    found = []
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[:1] not in (["cgroup"], ["cgroup2"]):
            continue
        for folder, dirs, _ in os.walk(left.split()[4]):
            if os.path.basename(folder) == name:
                found += [folder, *(os.path.join(folder, d) for d in dirs)]
                dirs.clear()
    return sorted(set(found))


@dataclass(frozen=True)
class HostSnapshot:
    children: set[int]
    """Child processes of the test process."""
    mounts: list[str]
    """Mount points under the workspace root."""
    sessions: set[str]
    """Session folders on disk."""
    leftovers: list[str]
    """Files under the replica's folder that belong to no session, snapshot or fixed part of it."""
    cgroups: list[str]
    """The replica's cgroup folders."""
    root_entries: list[str]
    """What the workspace root holds."""


REPLICA_PARTS = {"etc", "plugins", "ro", "sessions", "snapshots"}


def host_snapshot(settings: Settings) -> HostSnapshot:
    replica = settings.workspace_root / settings.replica
    sessions = replica / "sessions"
    leftovers = []
    if replica.is_dir():
        leftovers = sorted(p.name for p in replica.iterdir() if p.name not in REPLICA_PARTS)
        leftovers += sorted(p.name for p in (replica / "snapshots").glob("*.part-*"))
    return HostSnapshot(
        children=children(),
        mounts=mounts_under(settings.workspace_root),
        sessions={p.name for p in sessions.iterdir()} if sessions.is_dir() else set(),
        leftovers=leftovers,
        cgroups=cgroup_dirs(settings.replica),
        root_entries=sorted(p.name for p in settings.workspace_root.iterdir()),
    )


def session_traces(settings: Settings, session_id: str) -> list[str]:
    """What of one session is still on the host: its folder, mounts and cgroup folders."""
    folder = settings.workspace_root / settings.replica / "sessions" / session_id
    traces = [str(folder)] if folder.exists() else []
    traces += [m for m in mounts_under(settings.workspace_root) if session_id in m]
    traces += [d for d in cgroup_dirs(settings.replica) if os.path.basename(d) == session_id]
    return traces


async def eventually(check: Callable[[], object], *, within_s: float = 5.0) -> object:
    """Poll `check` until it returns something truthy (and return that), or return its last answer."""
    deadline = time.monotonic() + within_s
    while True:
        answer = check()
        if answer or time.monotonic() > deadline:
            return answer
        await asyncio.sleep(0.05)


def service_ports(settings: Settings) -> dict[str, int]:
    """The loopback ports of the servers the service talks to."""
    from urllib.parse import urlsplit

    ports = {}
    for name, url in (
        ("nats", settings.nats_url),
        ("redis", settings.redis_url),
        ("s3", settings.s3_endpoint),
    ):
        parsed = urlsplit(url if "://" in url else f"http://{url}")
        if parsed.port:
            ports[name] = parsed.port
    return ports


def named(prefix: str) -> dict[int, str]:
    """Host processes whose argv[0] starts with `prefix` (set with bash's `exec -a`)."""
    return {pid: line for pid, line in with_marker(prefix).items() if line.startswith(prefix)}


def section(output: str, title: str) -> str:
    """The lines a script printed after `== title` and before the next `== ` line."""
    lines, inside = [], False
    for line in output.splitlines():
        if line.startswith("== "):
            inside = line == f"== {title}"
        elif inside:
            lines.append(line)
    return "\n".join(lines).strip()
