"""Checks a task archive (tar.gz) before anything is unpacked.

Only the member headers are read here, on the host; the unpacking itself runs inside the sandbox, so
even an archive that slipped past these checks can write nowhere but the workspace.
"""

from __future__ import annotations

import io
import posixpath
import tarfile


class BadArchive(ValueError):
    pass


def _inside(path: str) -> bool:
    normal = posixpath.normpath(path)
    return not posixpath.isabs(path) and normal != ".." and not normal.startswith("../")


def check_archive(data: bytes, *, max_bytes: int, max_members: int) -> int:
    """Raise BadArchive unless every member stays inside the archive root; return the member count.

    Refused: absolute names, `..` components, symlinks or hard links pointing outside the root,
    device files and fifos, more than `max_members` members or `max_bytes` unpacked.
    """
    total = count = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar:
                count += 1
                if count > max_members:
                    raise BadArchive(f"more than {max_members} members")
                name = member.name
                if posixpath.isabs(name) or ".." in name.split("/"):
                    raise BadArchive(f"member {name!r} leaves the archive root")
                if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
                    raise BadArchive(f"member {name!r} is a device or fifo")
                if member.issym() and not _inside(posixpath.join(posixpath.dirname(name), member.linkname)):
                    raise BadArchive(
                        f"symlink {name!r} -> {member.linkname!r} points outside the archive root"
                    )
                if member.islnk() and not _inside(member.linkname):
                    raise BadArchive(
                        f"hard link {name!r} -> {member.linkname!r} points outside the archive root"
                    )
                total += member.size
                if total > max_bytes:
                    raise BadArchive(f"unpacks to more than {max_bytes} bytes")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise BadArchive(f"not a readable tar.gz: {exc}") from exc
    return count
