"""One Crucible service (`python -m services.<name>`) as a supervised child process of the local stack."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from crucible.localstack.processes import LOOPBACK, log_tail, spawn, stop_processes

SERVICES = ("catalog", "sandbox", "rollout", "grader", "trainer", "checkpoints", "api")
"""Every service, in the order the stack starts them."""


class ServiceError(RuntimeError):
    """A service exited or did not become ready; the message ends with the last lines of its log."""


@dataclass
class ServiceProcess:
    name: str
    env: dict[str, str]
    http_port: int
    log_path: Path
    cwd: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    exit_seen: bool = field(default=False, repr=False)

    @property
    def readyz_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}/readyz"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def returncode(self) -> int | None:
        return self.process.poll() if self.process else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def state(self) -> str:
        if self.process is None:
            return "not started"
        code = self.process.poll()
        return "running" if code is None else f"exited ({code})"

    def start(self) -> None:
        if self.alive():
            raise ServiceError(f"{self.name} is already running (pid {self.pid})")
        self.process = spawn(
            argv=[sys.executable, "-m", f"services.{self.name}"],
            log_path=self.log_path,
            env=self.env,
            cwd=self.cwd,
        )
        self.starts += 1
        self.exit_seen = False

    def is_ready(self) -> bool:
        try:
            return httpx.get(self.readyz_url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, *, deadline: float) -> None:
        wait_all_ready([self], deadline=deadline)

    def error(self, reason: str) -> ServiceError:
        """A ServiceError that ends with the last lines of this service's log."""
        return ServiceError(f"{self.name} {reason}; last log lines ({self.log_path}):\n{self.log_tail()}")

    def signal(self, sig: signal.Signals, *, wait_s: float = 10.0) -> int | None:
        """Send `sig`; for SIGTERM/SIGKILL wait up to `wait_s` for the exit and return the exit code."""
        if not self.alive():
            raise ServiceError(f"{self.name} is not running")
        assert self.process is not None
        self.exit_seen = True
        self.process.send_signal(sig)
        if sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGINT):
            try:
                return self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                return None
        return None

    def stop(self, *, grace_s: float) -> None:
        if self.process is not None:
            self.exit_seen = True
            stop_processes([self.process], grace_s=grace_s)

    def log_tail(self, *, lines: int = 30) -> str:
        return log_tail(path=self.log_path, lines=lines)


def wait_all_ready(services: list[ServiceProcess], *, deadline: float) -> None:
    """Wait for every service's /readyz at once, failing as soon as one of them exits."""
    pending = list(services)
    while pending:
        for service in list(pending):
            if service.is_ready():
                pending.remove(service)
            elif not service.alive():
                raise service.error(f"exited with code {service.returncode} before it was ready")
        if pending and time.monotonic() > deadline:
            raise pending[0].error(f"was not ready at {pending[0].readyz_url} in time")
        if pending:
            time.sleep(0.2)
