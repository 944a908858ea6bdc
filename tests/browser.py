"""Load a page in headless Chromium (Debian's `chromium`) and read back the DOM its scripts built."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--metrics-recording-only", "--virtual-time-budget=8000")  # fmt: skip


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (make system-packages installs it)")
        pytest.skip("chromium is not installed")
    return path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="crucible-chromium-") as profile:
        return subprocess.run(
            [chromium(), *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "HOME": profile},
        )  # fmt: skip


def dom(url: str) -> str:
    """The page's DOM after its scripts ran (within Chromium's virtual time budget)."""
    result = _run("--dump-dom", url)
    assert result.returncode == 0 and result.stdout, result.stderr[-2000:]
    return result.stdout


def screenshot(url: str, path: Path, *, size: str = "1280,1400") -> None:
    result = _run(f"--screenshot={path}", f"--window-size={size}", "--hide-scrollbars", url)
    assert result.returncode == 0 and path.is_file(), result.stderr[-2000:]
