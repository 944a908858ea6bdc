"""Task archives are reproducible byte for byte and read back to the same files."""

from __future__ import annotations

import hashlib

from services.catalog.snapshots import tarball, untar

FILES = {
    "pkg/__init__.py": "",
    "pkg/core.py": "def f():\n    return 1\n",
    "README.md": "# pkg\n\nnon-ascii: é…\n",
}


def test_same_files_same_bytes_in_any_order():
    reordered = dict(reversed(list(FILES.items())))
    assert tarball(FILES) == tarball(reordered)


def test_round_trip_and_content_changes_the_digest():
    data = tarball(FILES)
    assert untar(data) == FILES
    changed = tarball({**FILES, "pkg/core.py": "def f():\n    return 2\n"})
    assert hashlib.sha256(changed).hexdigest() != hashlib.sha256(data).hexdigest()
