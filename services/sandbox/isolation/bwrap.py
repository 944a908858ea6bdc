"""The isolation policy: how one command is started inside a session's sandbox.

Every command runs under bubblewrap with fresh user, pid, ipc, uts, mount and network namespaces
(loopback only; or the session's own loopback network once it runs a background job, see `network`),
no capabilities, no nested user namespaces, the system and this Python read-only, a
private /tmp of a fixed size, and the workspace read-write at /workspace. When the service runs as
root, the command runs as an unprivileged host uid, joins the session's cgroups (when the host lets us
make them), and gets its rlimits, all set before bubblewrap starts (see `launcher`), so nothing inside
can raise them. bubblewrap itself starts with an empty environment and reads its options from a pipe:
its own process, pid 1 inside, shows nothing of the host's under /proc/1/environ or /proc/1/cmdline.
When bubblewrap's monitor dies, the kernel kills the whole pid namespace, so killing it kills every
process the command started, including ones that daemonised.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from crucible.contracts.sandbox import ToolResult
from services.sandbox.isolation.process import Capture, Job, execute

WORKSPACE = "/workspace"
PLUGIN_DIR = "/crucible/plugins"
"""Where the sandbox sees the service's pytest report script (read-only)."""
OPTIONS_MAX_BYTES = 60 * 1024
"""bubblewrap's options are written whole into a pipe before it starts: below a pipe's 64 KiB."""
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
    """Address space of one process (the session's cgroup bounds their sum, where there is one)."""
    max_processes: int
    """Processes of the sandbox uid at once (RLIMIT_NPROC): per sandbox where cgroups are missing."""
    max_write_bytes: int
    cpu_seconds: int
    open_files: int

    def prlimit_options(self) -> list[str]:
        return [
            f"--as={self.memory_bytes}",
            f"--nproc={self.max_processes}",
            f"--fsize={self.max_write_bytes}",
            f"--cpu={self.cpu_seconds}",
            f"--nofile={self.open_files}",
            "--core=0",
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
def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(
            f"{name} is not installed "
            "(bubblewrap: Debian's bubblewrap; prlimit, setpriv, nsenter: util-linux)"
        )
    return found


def bwrap_path() -> str:
    return _tool("bwrap")


@functools.cache
def bwrap_supports(option: str) -> bool:
    """Whether this bubblewrap knows `option` (--disable-userns needs 0.8 or later)."""
    try:
        out = subprocess.run(
            [bwrap_path(), "--help"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, RuntimeError, subprocess.TimeoutExpired):
        return False
    return option in out.stdout + out.stderr


def write_etc(directory: Path) -> Path:
    """Write the sandbox's own passwd, group and hosts (the host's are not shown inside)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in _ETC_SYNTHETIC.items():
        (directory / name).write_text(text)
        (directory / name).chmod(0o644)
    return directory


@dataclass(frozen=True, kw_only=True)
class Sandbox:
    limits: Limits
    etc_dir: Path
    ro_binds: Sequence[Bind] = field(
        default_factory=lambda: [Bind(source=p, dest=str(p)) for p in python_paths()]
    )
    """Host folders shown read-only inside (this Python, by default), at `dest`."""
    host_uid: int | None = None
    """The unprivileged host uid (and gid) commands run as; None keeps the service's own."""
    disable_userns: bool = True
    """Forbid new user namespaces inside (bubblewrap 0.8+)."""
    tmp_bytes: int | None = None
    """Size of each command's private /tmp (a tmpfs; bubblewrap 0.8+), None: the kernel's default."""
    shared_network: bool = False
    """Whether a session's commands may share one loopback network (see `network`; needs root)."""

    @property
    def owner(self) -> tuple[int, int] | None:
        """Who owns what the host writes into a workspace, so the sandbox can change it later."""
        return None if self.host_uid is None else (self.host_uid, self.host_uid)

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
            # The Python inside is the service's own: its pytest plugins are not the task's, and one of
            # them (pytest-asyncio) warns on every run, which used most of an agent's observation budget
            # (or stops a repository's `filterwarnings = error` run). A task that needs a plugin names it
            # in its test command (-p NAME); the catalog verifies the same way.
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "GIT_CONFIG_NOSYSTEM": "1",
            **extra,
        }

    def launcher(self, cgroup_procs: Sequence[str] = (), netns: int | None = None) -> list[str]:
        """What runs before bubblewrap, each exec'ing the next: a shell that joins the session's cgroups
        (as the service), nsenter (the session's network, when it has one), prlimit (the rlimits),
        setpriv (the unprivileged host uid). Separate programs rather than a preexec function, so that
        Python can spawn with vfork: a fork of a large service process costs milliseconds per command."""
        prefix: list[str] = []
        if cgroup_procs:
            joins = " && ".join(f"echo $$ > {shlex.quote(path)}" for path in cgroup_procs)
            prefix += [_tool("sh"), "-c", f'{joins} && unset PWD && exec "$@"', "sh"]  # PWD: the host's
        if netns is not None:
            # Opened through the service's own fd table: the descriptor is not passed down, so nothing
            # in the sandbox inherits it.
            prefix += [_tool("nsenter"), f"--net=/proc/{os.getpid()}/fd/{netns}", "--"]
        prefix += [_tool("prlimit"), *self.limits.prlimit_options(), "--"]
        if self.host_uid is not None:
            uid = str(self.host_uid)
            prefix += [_tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        return prefix

    @contextmanager
    def launch(
        self,
        command: Sequence[str],
        *,
        workspace: Path,
        binds: Sequence[Bind] = (),
        env: Mapping[str, str] = {},
        cgroup_procs: Sequence[str] = (),
        netns: int | None = None,
    ) -> Iterator[tuple[list[str], tuple[int, ...]]]:
        """The argv that runs `command` in a sandbox, and the fd to pass it: bubblewrap reads its
        options from a pipe (--args), so its own command line, pid 1's inside, shows no host path;
        `netns` is a network namespace to run in instead of a fresh one."""
        options = b"".join(
            os.fsencode(o) + b"\0"
            for o in self.options(workspace=workspace, binds=binds, env=env, own_network=netns is None)
        )
        if len(options) > OPTIONS_MAX_BYTES:
            raise ValueError(f"bubblewrap options of {len(options)} bytes do not fit a pipe")
        read, write = os.pipe()
        try:
            os.write(write, options)
        finally:
            os.close(write)
        try:
            argv = [*self.launcher(cgroup_procs, netns), bwrap_path(), "--args", str(read), "--", *command]
            yield argv, (read,)
        finally:
            os.close(read)

    async def run(
        self,
        command: Sequence[str],
        *,
        workspace: Path,
        timeout_s: float,
        output_cap: int = 64 * 1024,
        binds: Sequence[Bind] = (),
        env: Mapping[str, str] = {},
        stdin: bytes | None = None,
        cgroup_procs: Sequence[str] = (),
        netns: int | None = None,
        stderr: Capture | None = None,
        keep_tail: bool = True,
    ) -> ToolResult:
        """Run `command` in a sandbox over `workspace` and wait for it (see `process.execute`)."""
        with self.launch(
            command, workspace=workspace, binds=binds, env=env, cgroup_procs=cgroup_procs, netns=netns
        ) as (argv, fds):
            return await execute(
                argv,
                timeout_s=timeout_s,
                output_cap=output_cap,
                stdin=stdin,
                env={},
                pass_fds=fds,
                stderr=stderr,
                keep_tail=keep_tail,
            )

    async def start(
        self,
        command: Sequence[str],
        *,
        workspace: Path,
        output_cap: int,
        lifetime_s: float,
        cgroup_procs: Sequence[str] = (),
        netns: int | None = None,
    ) -> Job:
        """Start `command` in a sandbox over `workspace` in the background."""
        with self.launch(command, workspace=workspace, cgroup_procs=cgroup_procs, netns=netns) as (argv, fds):
            return await Job.start(argv, output_cap=output_cap, lifetime_s=lifetime_s, env={}, pass_fds=fds)

    def options(
        self,
        *,
        workspace: Path,
        binds: Sequence[Bind] = (),
        env: Mapping[str, str] = {},
        own_network: bool = True,
    ) -> list[str]:
        """bubblewrap's options: the whole isolation policy (`own_network` False: stay in the network
        namespace bubblewrap starts in, the session's; see `network`)."""
        args = [
            "--unshare-all",
            *([] if own_network else ["--share-net"]),
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
        tmp_size = ["--size", str(self.tmp_bytes)] if self.tmp_bytes and bwrap_supports("--size") else []
        args += ["--proc", "/proc", "--dev", "/dev", *tmp_size, "--tmpfs", "/tmp"]
        for bind in self.ro_binds:
            args += ["--ro-bind", str(bind.source), bind.dest]
        args += ["--bind", str(workspace), WORKSPACE, "--chdir", WORKSPACE]
        for bind in binds:
            args += ["--bind" if bind.writable else "--ro-bind", str(bind.source), bind.dest]
        args.append("--clearenv")
        for key, value in self.env(env).items():
            args += ["--setenv", key, value]
        return args
