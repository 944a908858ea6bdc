"""Run the real `crucible` command in a subprocess, as a user would (wide, colourless output)."""

from __future__ import annotations

import os
import subprocess
import sys


def crucible(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from crucible.cli.main import app; app()", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})},
    )


def settings_env(settings) -> dict[str, str]:  # any pydantic settings
    """The environment that gives a service (or the CLI) these settings."""
    import json

    env = dict(os.environ)
    for name, value in settings.model_dump(mode="json").items():
        if value is None:  # unset: the setting's default
            continue
        env[f"CRUCIBLE_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


async def crucible_async(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> tuple[int, str, str]:
    """`crucible` in a subprocess without blocking the event loop (for tests whose services run in it)."""
    import asyncio

    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from crucible.cli.main import app; app()", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})},
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), timeout=timeout)
    return process.returncode or 0, out.decode(), err.decode()
