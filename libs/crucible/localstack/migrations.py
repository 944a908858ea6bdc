"""Run the database migrations as their own step, before any service that uses the database starts."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping


class MigrationError(RuntimeError):
    """`python -m crucible.db upgrade` failed; the message carries its output."""


def check_database_url(database_url: str) -> str:
    """The URL with its async driver (postgresql:// becomes postgresql+asyncpg://); ValueError names the
    scheme, never the password, when the database is not one Crucible supports."""
    from crucible.db.session import async_url

    return async_url(database_url)


def run_migrations(
    *, database_url: str, env: Mapping[str, str] | None = None, timeout_s: float = 300.0
) -> str:
    """Upgrade the schema at `database_url` to the newest migration; returns the tool's output."""
    child_env = {**os.environ, **(env or {}), "CRUCIBLE_DATABASE_URL": check_database_url(database_url)}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "crucible.db", "upgrade"],
            check=False,
            env=child_env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        raise MigrationError(f"migrations did not finish within {timeout_s:.0f}s") from exc
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        tail = "\n".join(output.splitlines()[-25:])
        raise MigrationError(f"migrations failed (exit {done.returncode}); last lines of output:\n{tail}")
    return output
