"""Child-process plumbing shared by the embedded servers and the local stack: free loopback ports,
finding the binaries that ship as Python packages, starting a process with its output in a log file
(and, on Linux, a SIGTERM when its parent dies, however it dies), and stopping processes (SIGTERM, a
grace period, then SIGKILL)."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

LOOPBACK = "127.0.0.1"


def free_ports(*, count: int) -> list[int]:
    """Ports free on the loopback interface right now; all held open together so they differ."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((LOOPBACK, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def port_open(*, host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def find_binary(*, name: str, package: str) -> Path:
    """A server binary installed by a Python package into this interpreter's scripts directory."""
    candidates = [Path(sysconfig.get_path("scripts")) / name, Path(sys.executable).parent / name]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found:
        return Path(found)
    raise FileNotFoundError(
        f"{name} not found; install it with `pip install {package}` (or `pip install -e '.[local]'`)"
    )


PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _die_with(parent: int):
    """A preexec function: the child gets SIGTERM when `parent` dies (even by SIGKILL), and if `parent`
    is already gone when it starts, ends at once. (The kernel's parent-death signal follows the thread
    that forked; the stack spawns from threads that live as long as it.)"""

    def setup() -> None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return setup


def spawn(
    *,
    argv: Sequence[str | os.PathLike[str]],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start a child in its own session (a terminal's Ctrl-C reaches only the parent, which then stops
    children in order), stdout and stderr appended to `log_path`; it gets SIGTERM if the parent dies
    without stopping it."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [os.fspath(a) for a in argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with(os.getpid()) if _LIBC is not None else None,
        )


def log_tail(*, path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def stop_processes(processes: Iterable[subprocess.Popen[bytes]], *, grace_s: float) -> None:
    """SIGTERM every live process at once, wait up to `grace_s` for all, SIGKILL the stragglers."""
    live = [p for p in processes if p.poll() is None]
    for process in live:
        _signal(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in live:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(process, signal.SIGKILL)
            process.wait()


def _signal(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        process.send_signal(sig)
    except ProcessLookupError:
        pass
