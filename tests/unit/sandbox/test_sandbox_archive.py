import io
import tarfile

import pytest
from sandbox_archives import make_tar

from services.sandbox.isolation.archive import BadArchive, check_archive

LIMITS = {"max_bytes": 10_000, "max_members": 10}


def tar_with(info: tarfile.TarInfo, data: bytes = b"") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


def test_accepts_a_plain_repository_with_inner_links():
    data = make_tar({"a/b.py": "x = 1\n", "c.txt": "c"}, links={"a/link.py": "b.py", "up": "a/../c.txt"})
    assert check_archive(data, **LIMITS) == 4


@pytest.mark.parametrize(
    "data, reason",
    [
        (make_tar({"/etc/cron.d/x": "boom"}), "leaves the archive root"),
        (make_tar({"a/../../x": "boom"}), "leaves the archive root"),
        (make_tar({}, links={"passwd": "/etc/passwd"}), "points outside"),
        (make_tar({}, links={"a/up": "../../etc"}), "points outside"),
        (make_tar({f"f{i}": "" for i in range(11)}), "more than 10 members"),
        (make_tar({"big": "x" * 10_001}), "more than 10000 bytes"),
        (b"not a tarball at all", "not a readable tar.gz"),
    ],
    ids=["absolute", "dotdot", "absolute-link", "dotdot-link", "members", "bytes", "not-a-tarball"],
)
def test_refuses(data, reason):
    with pytest.raises(BadArchive, match=reason):
        check_archive(data, **LIMITS)


def test_refuses_hard_links_out_and_devices():
    link = tarfile.TarInfo("h")
    link.type, link.linkname = tarfile.LNKTYPE, "../outside"
    with pytest.raises(BadArchive, match="hard link"):
        check_archive(tar_with(link), **LIMITS)
    device = tarfile.TarInfo("dev")
    device.type = tarfile.CHRTYPE
    with pytest.raises(BadArchive, match="device or fifo"):
        check_archive(tar_with(device), **LIMITS)
