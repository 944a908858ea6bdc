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
