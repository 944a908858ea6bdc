"""A session's own loopback network, so that a server its background job starts answers the session's
later commands (and nobody else's).

Each command otherwise gets a fresh, empty network namespace from bubblewrap. When the service may
(root with CAP_SYS_ADMIN), a session's first background job makes a network namespace holding only
`lo`, kept alive by an open descriptor; that job and every later command of the session enter it with
nsenter before dropping to the sandbox uid. Nothing inside can change it: the sandbox has no
capabilities, and the namespace belongs to the host's user namespace.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import socket
import struct
import threading

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
_libc = ctypes.CDLL(None, use_errno=True)


def _in_new_namespace() -> int:
    """In the calling thread: move into a new network namespace, bring `lo` up, and open it."""
    if _libc.unshare(CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"unshare(CLONE_NEWNET): {os.strerror(code)}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    return os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY | os.O_CLOEXEC)


def loopback_namespace() -> int:
    """A new network namespace with only `lo`, up; the open descriptor keeps it alive (close it to let
    it go once its processes are gone). A thread of its own makes it: the namespace is per thread, and
    that thread ends right after, so no other work ever runs inside it."""
    made: list[int] = []
    failed: list[BaseException] = []

    def make() -> None:
        try:
            made.append(_in_new_namespace())
        except BaseException as exc:  # handed to the caller below
            failed.append(exc)

    thread = threading.Thread(target=make, name="crucible-netns", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return made[0]


def can_share_network() -> bool:
    """Whether this process may make and enter network namespaces (root with CAP_SYS_ADMIN, and
    util-linux's nsenter installed)."""
    if os.geteuid() != 0 or shutil.which("nsenter") is None:
        return False
    try:
        os.close(loopback_namespace())
    except OSError:
        return False
    return True
