"""Per-session cgroups: memory, process-count and CPU limits on everything a session runs, together.

Used where the host lets the service make cgroups: cgroup v2 when the service's own cgroup delegates
the controllers to its children, cgroup v1 when the memory, pids and cpu hierarchies are writable.
Elsewhere `Cgroups.detect` returns None and only the rlimits apply. Every command of a session joins
its cgroup before bubblewrap starts; destroying the session kills whatever is left in it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under '' its v2 path."""
    paths: dict[str, str] = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def _mounts() -> dict[str, Path]:
    """Mount point per v1 controller, and under '' the v2 mount."""
    found: dict[str, Path] = {}
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        point, fstype, options = Path(fields[4]), rest[0], rest[2].split(",")
        if fstype == "cgroup2":
            found.setdefault("", point)
        elif fstype == "cgroup":
            for name in CONTROLLERS:
                if name in options:
                    found.setdefault(name, point)
    return found


@dataclass(frozen=True)
class Counters:
    oom_kills: int
    pids_refused: int


@dataclass
class Cgroup:
    """One session's cgroup: a folder per v1 controller, or one folder under v2."""

    dirs: dict[str, Path]
    v2: bool

    @property
    def procs_files(self) -> list[str]:
        return sorted({str(d / "cgroup.procs") for d in self.dirs.values()})

    def counters(self) -> Counters:
        if self.v2:
            d = self.dirs["memory"]
            mem, pids = _kv(d / "memory.events"), _kv(d / "pids.events")
            return Counters(oom_kills=mem.get("oom_kill", 0), pids_refused=pids.get("max", 0))
        oom = _kv(self.dirs["memory"] / "memory.oom_control").get("oom_kill", 0)
        return Counters(oom_kills=oom, pids_refused=_kv(self.dirs["pids"] / "pids.events").get("max", 0))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs.values():
            found.update(int(p) for p in _read(d / "cgroup.procs").split())
        return found

    def kill(self) -> None:
        """SIGKILL every process in the cgroup until none is left (they may be forking)."""
        if self.v2 and (self.dirs["memory"] / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (self.dirs["memory"] / "cgroup.kill").write_text("1")
        for _ in range(100):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill()
        for d in self.dirs.values():
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # the last killed processes are still being reaped
                    time.sleep(0.01)


def _kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in _read(path).splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


CGROUP_PREFIX = "crucible-sandbox-"


def replica_cgroup(replica: str) -> str:
    """The name of `replica`'s parent cgroup (its sessions' cgroups are folders in it)."""
    return f"{CGROUP_PREFIX}{replica}"


@dataclass
class Cgroups:
    """Where this replica makes its sessions' cgroups, and the limits it writes into each."""

    parents: dict[str, Path]
    v2: bool
    memory_bytes: int
    max_processes: int
    cpus: float

    @staticmethod
    def locate(replica: str) -> tuple[dict[str, Path], bool] | None:
        """Where `replica`'s parent cgroup per controller goes, and whether it is v2; None if nowhere."""
        own, mounts = _own_paths(), _mounts()
        name = replica_cgroup(replica)
        if all(c in mounts and c in own for c in CONTROLLERS):
            return {c: mounts[c] / own[c].lstrip("/") / name for c in CONTROLLERS}, False
        if "" in mounts and "" in own:
            base = mounts[""] / own[""].lstrip("/")
            if all(c in _read(base / "cgroup.subtree_control").split() for c in CONTROLLERS):
                return {c: base / name for c in CONTROLLERS}, True
        return None

    @classmethod
    def detect(cls, *, replica: str, memory_bytes: int, max_processes: int, cpus: float) -> Cgroups | None:
        """This replica's parent cgroup(s), made now; None when the host does not let us."""
        where = cls.locate(replica)
        if where is None:
            return None
        parents, v2 = where
        made = cls(parents=parents, v2=v2, memory_bytes=memory_bytes, max_processes=max_processes, cpus=cpus)
        try:
            for d in set(parents.values()):
                d.mkdir(exist_ok=True)
            if v2:
                (parents["memory"] / "cgroup.subtree_control").write_text("+memory +pids +cpu")
            made.create("probe").remove()
        except OSError:
            made.close()
            return None
        return made

    @classmethod
    def sweep_replica(cls, replica: str) -> None:
        """Remove the cgroups an earlier run of `replica` left, and its parents."""
        where = cls.locate(replica)
        if where is not None:
            _remove_all(*where)

    def create(self, session_id: str) -> Cgroup:
        """A cgroup for one session, with its limits written; OSError if the host refuses."""
        dirs = {c: self.parents[c] / session_id for c in CONTROLLERS}
        for d in set(dirs.values()):
            d.mkdir(exist_ok=True)
        group = Cgroup(dirs=dirs, v2=self.v2)
        quota = max(1000, int(self.cpus * CPU_PERIOD_US))
        if self.v2:
            d = dirs["memory"]
            (d / "memory.max").write_text(str(self.memory_bytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(self.max_processes))
            (d / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
        else:
            (dirs["memory"] / "memory.limit_in_bytes").write_text(str(self.memory_bytes))
            (dirs["pids"] / "pids.max").write_text(str(self.max_processes))
            (dirs["cpu"] / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))
        return group

    def close(self) -> None:
        """Remove every session cgroup (killing what is left in them) and the parents."""
        _remove_all(self.parents, self.v2)


def _remove_all(parents: dict[str, Path], v2: bool) -> None:
    for parent in set(parents.values()):
        for child in parent.iterdir() if parent.exists() else []:
            if child.is_dir():
                Cgroup(dirs={c: parents[c] / child.name for c in CONTROLLERS}, v2=v2).remove()
    for d in set(parents.values()):
        with contextlib.suppress(OSError):
            d.rmdir()
