"""Reproducible tar.gz archives of a task's files.

Fixed timestamps, owners and modes, and sorted members: the same files always give the same bytes,
so a sha256 says whether a stored snapshot is already the one the generator would produce.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import Mapping


def tarball(files: Mapping[str, str]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(files):
            data = files[path].encode("utf-8")
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), compresslevel=9, mtime=0)


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
