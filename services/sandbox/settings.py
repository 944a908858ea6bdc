"""Sandbox service settings (env prefix CRUCIBLE_)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from pydantic import Field, field_validator

from crucible.contracts.runconfig import MAX_GROUP_SIZE
from crucible.settings import CommonSettings


class Settings(CommonSettings):
    workspace_root: Path = Field(default_factory=lambda: Path(tempfile.gettempdir()) / "crucible-sandbox")
    """Where session workspaces live on this machine; each session gets a folder, removed on destroy."""
    max_sessions: int = Field(default=32, ge=1)
    """Sessions this replica holds at once; `sandbox.create` answers `busy` beyond that."""
    max_ttl_s: float = Field(default=3600.0, gt=0)
    """Upper bound on a session's idle TTL, whatever the request asks."""
    reap_interval_s: float = Field(default=5.0, gt=0)
    run_timeout_s: float = Field(default=60.0, gt=0)
    """Timeout of a command when the caller names none."""
    max_run_timeout_s: float = Field(default=900.0, gt=0)
    output_cap_bytes: int = Field(default=16 * 1024, ge=256)
    """Output kept from a command when the caller names no cap: its head and its tail."""
    max_output_cap_bytes: int = Field(default=1024 * 1024, ge=256)
    read_max_lines: int = Field(default=400, ge=1)
    """Lines one read_file call returns at most."""
    max_file_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    """Largest file read_file and replace will open."""
    list_max_entries: int = Field(default=500, ge=1)
    grep_max_matches: int = Field(default=200, ge=1)
    max_snapshot_bytes: int = Field(default=512 * 1024 * 1024, ge=1024)
    """Largest unpacked size of a snapshot or overlay archive."""
    max_snapshot_members: int = Field(default=100_000, ge=1)
    max_diff_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    memory_bytes: int = Field(default=4 * 1024**3, ge=64 * 1024**2)
    """Memory of a session's processes together (cgroup), and address space of each one (rlimit)."""
    max_processes: int = Field(default=256, ge=8)
    """Processes of one session at once (cgroup). Where there are no cgroups, the rlimit with this
    value counts every process of the sandbox uid, all sessions together."""
    max_processes_per_uid: int = Field(default=8192, ge=64)
    """With cgroups: the rlimit on all processes of the sandbox uid, every session together."""
    cpus: float = Field(default=1.0, gt=0)
    """CPU time of one session per wall second (cgroup)."""
    max_write_bytes: int = Field(default=1024**3, ge=1024**2)
    """Largest file a sandboxed process may write."""
    disk_quota_bytes: int = Field(default=1024**3, ge=1024**2)
    """What one session may write in its workspace: its upper layer, on a tmpfs of this size (when the
    service may mount; otherwise only max_write_bytes per file applies). Each command's private /tmp
    is a tmpfs of this size too."""
    disk_quota_inodes: int = Field(default=200_000, ge=1024)
    overlay_workspaces: bool = True
    """Overlay workspaces with a quota where the service may mount; False: full copies everywhere."""
    cpu_seconds: int = Field(default=900, ge=1)
    open_files: int = Field(default=1024, ge=64)
    sandbox_uid: int = Field(default=61000, ge=1)
    """The unprivileged host uid and gid sandboxed commands run as, when the service runs as root."""
    snapshot_cache_size: int = Field(default=64, ge=1)
    """Unpacked task snapshots kept on this replica when no session uses them."""
    max_fork: int = Field(default=MAX_GROUP_SIZE, ge=1)
    """Copies one `sandbox.<replica>.fork` call may make (a run's group_size is bounded by the default)."""
    max_background_jobs: int = Field(default=4, ge=1)
    """Background commands one session may have at once."""
    extra_ro_paths: list[Path] = Field(default_factory=list)
    """Host folders mounted read-only at the same path inside (besides the system and this Python)."""

    @field_validator("replica")
    @classmethod
    def _replica_is_a_subject_token(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", value):
            raise ValueError(f"{value!r}: a sandbox replica name is one NATS subject token ([A-Za-z0-9_-]+)")
        return value
