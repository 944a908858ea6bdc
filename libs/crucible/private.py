"""Files that hold a credential (an API key, an NKey seed, S3 keys): readable by their owner alone."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """Write `text` and a newline to `path` with mode 0600 (made so, never widened in between)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    path.chmod(0o600)
