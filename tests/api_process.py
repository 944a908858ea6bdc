"""The api as operators run it, `python -m services.api` from its image (no torch), for the tests that
need the live service: its lifecycle, and schemathesis against its OpenAPI document."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from crucible.apikeys import Scope, make_key
from crucible.settings import CommonSettings

TORCHLESS = Path(__file__).resolve().parent / "torchless.py"


def start_api(settings: CommonSettings, log: Path) -> subprocess.Popen[bytes]:
    """Start the api with `settings` as its CRUCIBLE_* environment and torch unimportable."""
    values = {
        f"CRUCIBLE_{key.upper()}": str(value)
        for key, value in settings.model_dump().items()
        if value is not None
    }
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, str(TORCHLESS), "services.api"],
            env={**os.environ, **values},
            stdout=out,
            stderr=out,
        )


def wait_ready(base: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    """Until `{base}/readyz` answers 200; fails with the api's log if it exits or never gets ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"api exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"api not ready after {timeout}s:\n{log.read_text()}")


def key_headers(database_url: str, scope: Scope = "admin") -> dict[str, str]:
    """Headers carrying a new API key of `scope`, made in the api's database."""
    return {"Authorization": f"Bearer {make_key(database_url, scope=scope, name=f'test-{scope}')}"}
