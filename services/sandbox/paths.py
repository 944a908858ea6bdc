"""Host-side path checks: a path the agent names must resolve to somewhere inside its workspace.

Symlinks are resolved before the check, so a link planted in the workspace that points at a host file
is refused rather than followed. Tool calls of one session are serialised and no sandboxed process
outlives its command, so nothing can swap a link between the check and the use.
"""

from __future__ import annotations

import os
from pathlib import Path

from services.sandbox.bwrap import WORKSPACE


class PathRefused(ValueError):
    pass


def resolve(root: Path, path: str) -> Path:
    """The real path of `path` (relative to the workspace, or absolute under /workspace), if inside."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise PathRefused(f"not a usable path: {path!r}")
    if path == WORKSPACE or path.startswith(WORKSPACE + "/"):
        path = path[len(WORKSPACE) :].lstrip("/") or "."
    if os.path.isabs(path):
        raise PathRefused(f"{path}: absolute paths must be under {WORKSPACE}")
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(real_root / path))
    if real != real_root and not real.is_relative_to(real_root):
        raise PathRefused(f"{path}: resolves outside the workspace")
    return real


def relative(root: Path, real: Path) -> str:
    """How the agent names `real`: relative to the workspace root."""
    return str(real.relative_to(os.path.realpath(root))) if real != Path(os.path.realpath(root)) else "."
