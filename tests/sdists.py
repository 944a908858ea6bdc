"""Real projects' source distributions (toolz, more-itertools), fetched by `make sdists`, unpacked for a
test."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

SDISTS = Path(__file__).resolve().parents[1] / ".crucible" / "sdists"


def unpack(name: str, into: Path) -> Path:
    """The project's source tree, unpacked under `into`."""
    archives = sorted(SDISTS.glob(f"{name}-*.tar.gz"))
    if not archives:
        pytest.fail(f"no {name} source distribution in {SDISTS}: run `make sdists`")
    with tarfile.open(archives[-1]) as tar:
        tar.extractall(into, filter="data")
    [root] = [p for p in into.iterdir() if p.is_dir()]
    return root
