"""Reproducible tar.gz archives of a task's files.

Fixed timestamps, owners and modes, and sorted members: the same files always give the same bytes,
so a sha256 says whether a stored snapshot is already the one the generator would produce.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import Mapping
from pathlib import Path


def tarball(files: Mapping[str, str | bytes]) -> bytes:
    """Text is stored as UTF-8; bytes as they are (a real repository's binary files)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(files):
            value = files[path]
            data = value.encode("utf-8") if isinstance(value, str) else value
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), compresslevel=9, mtime=0)


def read_tree(root: Path) -> dict[str, bytes]:
    """Every regular file under `root` (relative POSIX path -> bytes), skipping .git and caches."""
    skip = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".tox", ".venv"}
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part in skip for part in rel.parts) or path.is_symlink() or not path.is_file():
            continue
        files[rel.as_posix()] = path.read_bytes()
    return files


def untar(data: bytes) -> dict[str, str]:
    """The files of an archive made by `tarball` (for tests and tools; the sandbox unpacks its own)."""
    files = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar:
            if not member.isfile():
                raise ValueError(f"unexpected archive member {member.name!r}")
            extracted = tar.extractfile(member)
            assert extracted is not None
            files[member.name] = extracted.read().decode("utf-8")
    return files
