"""The isolation policy: the bubblewrap command line that runs one command inside a session.

Every command gets fresh namespaces (no network but loopback, own pids, hostname, ipc), an
unprivileged uid in a user namespace with no capabilities, the system and this Python read-only, a
private /tmp, and the workspace read-write at /workspace. Resource limits are set by `prlimit` around
bubblewrap, so no sandboxed process can raise them. When bubblewrap dies, the kernel kills the whole
pid namespace, so killing it kills every process a command started.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

WORKSPACE = "/workspace"
UID = 1000
GID = 1000
SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "nsswitch.conf", "ssl")
_ETC_SYNTHETIC = {
    "passwd": f"root:x:0:0:root:/tmp:/bin/false\nsandbox:x:{UID}:{GID}:sandbox:/tmp:/bin/bash\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    "group": f"root:x:0:\nsandbox:x:{GID}:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
}


@dataclass(frozen=True, kw_only=True)
class Limits:
    memory_bytes: int
    max_processes: int
    max_write_bytes: int
    cpu_seconds: int
    open_files: int

    def prlimit_argv(self) -> list[str]:
        return [
            "prlimit",
            f"--as={self.memory_bytes}",
            f"--nproc={self.max_processes}",
            f"--fsize={self.max_write_bytes}",
            f"--cpu={self.cpu_seconds}",
            f"--nofile={self.open_files}",
            "--core=0",
            "--",
        ]


@dataclass(frozen=True, kw_only=True)
class Bind:
    source: Path
    dest: str
    writable: bool = False


def python_paths() -> list[Path]:
    """This interpreter's installation and virtualenv, so `python -m pytest` works inside."""
    found: list[Path] = []
    for prefix in {
        sys.base_prefix,
        sys.prefix,
        os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
    }:
        for path in {Path(prefix), Path(os.path.realpath(prefix))}:
            if not path.is_relative_to("/usr") and path not in found:
                found.append(path)
    return sorted(found)


@functools.cache
def bwrap_supports(option: str) -> bool:
    """Whether this bubblewrap knows `option` (--disable-userns needs 0.8 or later)."""
    try:
        out = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return option in out.stdout + out.stderr


def write_etc(directory: Path) -> Path:
    """Write the sandbox's own passwd, group and hosts (the host's are not shown inside)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in _ETC_SYNTHETIC.items():
        (directory / name).write_text(text)
    return directory


@dataclass(frozen=True, kw_only=True)
class Sandbox:
    limits: Limits
    etc_dir: Path
    ro_paths: Sequence[Path] = field(default_factory=python_paths)
    disable_userns: bool = True
    """Forbid new user namespaces inside (bubblewrap 0.8+)."""

    def path_env(self) -> str:
        venv_bin = [str(Path(sys.prefix) / "bin")] if sys.prefix != sys.base_prefix else []
        return ":".join([*venv_bin, "/usr/local/bin", "/usr/bin", "/bin"])

    def env(self, extra: Mapping[str, str] = {}) -> dict[str, str]:
        return {
            "PATH": self.path_env(),
            "HOME": "/tmp",
            "USER": "sandbox",
            "LOGNAME": "sandbox",
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "PYTHONDONTWRITEBYTECODE": "1",
            "GIT_CONFIG_NOSYSTEM": "1",
            **extra,
        }

    def argv(
        self,
        command: Sequence[str],
        *,
        workspace: Path,
        binds: Sequence[Bind] = (),
        env: Mapping[str, str] = {},
    ) -> list[str]:
        args = [
            *self.limits.prlimit_argv(),
            "bwrap",
            "--unshare-all",
            "--unshare-user",
            *(["--disable-userns"] if self.disable_userns else []),
            "--uid", str(UID),
            "--gid", str(GID),
            "--cap-drop", "ALL",
            "--hostname", "sandbox",
            "--die-with-parent",
            "--new-session",
            "--ro-bind", "/usr", "/usr",
        ]  # fmt: skip
        for path in SYSTEM_DIRS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for name in ETC_FILES:
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        for name in _ETC_SYNTHETIC:
            args += ["--ro-bind", str(self.etc_dir / name), f"/etc/{name}"]
        # The private /tmp first: an interpreter or venv that lives under the host's /tmp is bound on top.
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        for path in self.ro_paths:
            args += ["--ro-bind", str(path), str(path)]
        args += ["--bind", str(workspace), WORKSPACE, "--chdir", WORKSPACE]
        for bind in binds:
            args += ["--bind" if bind.writable else "--ro-bind", str(bind.source), bind.dest]
        args.append("--clearenv")
        for key, value in self.env(env).items():
            args += ["--setenv", key, value]
        return [*args, "--", *command]
