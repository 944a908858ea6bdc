"""Host-side file access that cannot leave the workspace: every path is opened with openat2(2) and
RESOLVE_BENEATH, so the kernel refuses a `..`, an absolute symlink or a magic /proc link that would
escape, at the moment of the open. A link the agent plants (or swaps in from a background process
between two calls) can never make the service read or write a host file.

The agent names paths relative to the workspace or absolute under /workspace.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from services.sandbox.isolation.bwrap import WORKSPACE

_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "riscv64": 437, "ppc64le": 437, "s390x": 437}
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
_libc = ctypes.CDLL(None, use_errno=True)


class PathRefused(ValueError):
    """The agent named a path that is not a usable path inside its workspace."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def relative_name(path: str) -> str:
    """The workspace-relative form of what the agent wrote; PathRefused for anything else."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise PathRefused(f"not a usable path: {path!r}")
    if path == WORKSPACE or path.startswith(WORKSPACE + "/"):
        path = path[len(WORKSPACE) :].lstrip("/") or "."
    if os.path.isabs(path):
        raise PathRefused(f"{path}: absolute paths must be under {WORKSPACE}")
    return path


_EAGAIN_TRIES = 100
"""openat2 answers EAGAIN when a `..` was resolved while any mount or rename happened on the host (other
sessions' sandboxes mount all the time); the kernel asks the caller to try again."""


def openat2(dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, _RESOLVE)
    number = _SYS_OPENAT2.get(platform.machine(), 437)
    code = errno.EAGAIN
    for _ in range(_EAGAIN_TRIES):
        fd = _libc.syscall(number, dir_fd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return fd
        code = ctypes.get_errno()
        if code != errno.EAGAIN:
            break
    raise OSError(code, os.strerror(code), path)


class Root:
    """The workspace folder, held open; every path operation resolves beneath it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    @contextmanager
    def fd(self) -> Iterator[int]:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        """Open `path` beneath the root. PathRefused if it escapes; FileNotFoundError etc. as usual."""
        name = relative_name(path)
        with self.fd() as root:
            try:
                return openat2(root, name, flags, mode)
            except OSError as exc:
                if exc.errno in (errno.EXDEV, errno.ELOOP):
                    raise PathRefused(f"{path}: resolves outside the workspace") from None
                raise

    def real(self, path: str) -> str:
        """Where `path` really is, relative to the root ('.' for the root itself), symlinks resolved."""
        fd = self.open(path, os.O_PATH)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        root = os.path.realpath(self.path)
        if target == root:
            return "."
        if not target.startswith(root + "/"):
            raise PathRefused(f"{path}: resolves outside the workspace")
        return target[len(root) + 1 :]

    def stat(self, path: str) -> os.stat_result:
        fd = self.open(path, os.O_PATH)
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except FileNotFoundError:
            return False
        return True

    def read_bytes(self, path: str, *, limit: int) -> bytes:
        """A regular file's bytes (O_NONBLOCK: a planted fifo cannot block the service)."""
        fd = self.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory", path)
            if not stat.S_ISREG(st.st_mode):
                raise PathRefused(f"{path}: not a regular file")
            if st.st_size > limit:
                raise PathRefused(f"{path}: {st.st_size} bytes, over the {limit} byte limit")
            return f.read(limit + 1)

    def parent(self, path: str, *, create: bool, owner: tuple[int, int] | None) -> tuple[int, str]:
        """An open fd of `path`'s folder (made, owned by `owner`, when `create`) and the last name."""
        name = relative_name(path).rstrip("/")
        head, _, leaf = name.rpartition("/")
        if leaf in ("", ".", ".."):
            raise PathRefused(f"{path}: names no file")
        if not head:
            return os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), leaf
        if create:
            self._makedirs(head, owner)
        return self.open(head, os.O_RDONLY | os.O_DIRECTORY), leaf

    def _makedirs(self, head: str, owner: tuple[int, int] | None) -> None:
        parts = [p for p in head.split("/") if p not in ("", ".")]
        done = ""
        for part in parts:
            if part == "..":
                raise PathRefused(f"{head}: '..' is not allowed in a new path")
            parent = self.open(done or ".", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.mkdir(part, 0o755, dir_fd=parent)
                if owner is not None:
                    os.chown(part, *owner, dir_fd=parent, follow_symlinks=False)
            except FileExistsError:
                pass
            finally:
                os.close(parent)
            done = f"{done}/{part}" if done else part

    def write_bytes(self, path: str, data: bytes, *, create: bool, owner: tuple[int, int] | None) -> bool:
        """Write a regular file (truncating it); return True if it was created. Never through a link."""
        parent, leaf = self.parent(path, create=create, owner=owner)
        try:
            try:
                st = os.stat(leaf, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise PathRefused(f"{path}: exists and is not a regular file")
            if st is None and not create:
                raise FileNotFoundError(errno.ENOENT, "no such file", path)
            flags = os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            fd = os.open(leaf, flags | (os.O_CREAT if st is None else 0), 0o644, dir_fd=parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if st is None and owner is not None:
                    os.fchown(f.fileno(), *owner)
            return st is None
        finally:
            os.close(parent)

    def unlink(self, path: str) -> None:
        parent, leaf = self.parent(path, create=False, owner=None)
        try:
            st = os.stat(leaf, dir_fd=parent, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory", path)
            os.unlink(leaf, dir_fd=parent)
        finally:
            os.close(parent)
