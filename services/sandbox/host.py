"""What the host lets a replica isolate sessions with, found out once at its start: mounting (overlay
workspaces with a disk quota), the unprivileged sandbox uid, per-session cgroups, a session's own
network, bubblewrap's options; the sandbox made to match; and the check that bubblewrap works here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from crucible import pytest_report
from services.sandbox.isolation import mounts, network
from services.sandbox.isolation.bwrap import (
    PLUGIN_DIR,
    Bind,
    Limits,
    Sandbox,
    bwrap_supports,
    python_paths,
    write_etc,
)
from services.sandbox.isolation.cgroups import Cgroups
from services.sandbox.settings import Settings


@dataclass(frozen=True, kw_only=True)
class Host:
    privileged: bool
    """Whether this replica may mount (root): overlay workspaces on a tmpfs quota, read-only views."""
    cgroups: Cgroups | None
    """This replica's parent cgroup(s) for per-session ones; None where the host does not let us."""
    sandbox: Sandbox
    """Bubblewrap as this host allows it: the sandbox uid, limits, binds, session networks."""


def probe(settings: Settings, root: Path) -> Host:
    """Find out what the host allows, and make the sandbox under `root` (the replica's new folder: its
    /etc, the pytest report plugin, read-only views the sandbox uid can reach)."""
    s = settings
    privileged = os.geteuid() == 0 and mounts.can_mount(root)
    host_uid = s.sandbox_uid if os.geteuid() == 0 else None
    if host_uid is not None and not _searchable_by_others(root):
        raise RuntimeError(
            f"workspace_root {s.workspace_root} is not reachable by the sandbox uid {host_uid}: "
            "every folder above it needs o+x"
        )
    ro_binds = []
    for i, path in enumerate([*python_paths(), *s.extra_ro_paths]):
        if host_uid is not None and privileged and not _searchable_by_others(path):
            view = root / "ro" / str(i)
            view.mkdir(parents=True)
            mounts.bind_readonly(path, view)  # reachable by the sandbox uid, still read-only
            ro_binds.append(Bind(source=view, dest=str(path)))
        else:
            ro_binds.append(Bind(source=path, dest=str(path)))
    ro_binds.append(Bind(source=pytest_report.install(root / "plugins").parent, dest=PLUGIN_DIR))
    cgroups = (
        Cgroups.detect(
            replica=s.replica, memory_bytes=s.memory_bytes, max_processes=s.max_processes, cpus=s.cpus
        )
        if os.geteuid() == 0
        else None
    )
    limits = Limits(
        memory_bytes=s.memory_bytes,
        # Without per-session cgroups, the rlimit is the only count limit (and counts per uid).
        max_processes=s.max_processes_per_uid if cgroups else s.max_processes,
        max_write_bytes=s.max_write_bytes,
        cpu_seconds=s.cpu_seconds,
        open_files=s.open_files,
    )
    sandbox = Sandbox(
        limits=limits,
        etc_dir=write_etc(root / "etc"),
        ro_binds=ro_binds,
        host_uid=host_uid,
        disable_userns=bwrap_supports("--disable-userns"),
        tmp_bytes=s.disk_quota_bytes,
        shared_network=network.can_share_network(),
    )
    return Host(privileged=privileged, cgroups=cgroups, sandbox=sandbox)


async def check(sandbox: Sandbox, root: Path) -> None:
    """Fail fast if bubblewrap cannot create its namespaces on this machine, or (where sessions get a
    network of their own) cannot run a command in one; `root` is the replica's folder."""
    probe = root / "probe"
    probe.mkdir(exist_ok=True)
    netns = network.loopback_namespace() if sandbox.shared_network else None
    try:
        for joined in [None, netns] if netns is not None else [None]:
            result = await sandbox.run(["true"], workspace=probe, timeout_s=30.0, netns=joined)
            if not result.ok:
                where = " in a session's network" if joined is not None else ""
                raise RuntimeError(
                    f"bubblewrap does not work here{where} ({result.error}): {result.output.strip()}"
                )
    finally:
        if netns is not None:
            os.close(netns)
        probe.rmdir()


def _searchable_by_others(path: Path) -> bool:
    """Whether a process of another uid can reach `path` (every folder above it has o+x)."""
    for folder in [path, *path.parents]:
        if folder.exists() and not os.stat(folder).st_mode & 0o001:
            return False
    return True
