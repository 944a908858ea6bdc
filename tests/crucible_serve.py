"""`crucible serve` as a child process, as a user starts it: the base URL once the app answers."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


@contextmanager
def crucible_serve(*args: str) -> Iterator[str]:
    """Serve with `args` (the source first) on a free loopback port; yields the `/v1` base URL."""
    process = subprocess.Popen(
        [sys.executable, "-c", "from crucible.cli.main import app; app()", "serve", *args, "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = process.stdout.readline()  # "serving NAME on URL", once the model is loaded
        assert " on http" in line, process.stderr.read()
        url = line.rsplit(" on ", 1)[1].strip()
        deadline = time.monotonic() + 60
        while True:  # the socket is bound: wait until the app answers
            try:
                if httpx.get(url.removesuffix("/v1") + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and process.poll() is None, "the server did not come up"
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
