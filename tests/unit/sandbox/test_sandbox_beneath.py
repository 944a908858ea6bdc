"""Host-side access beneath the workspace (services/sandbox/isolation/beneath.py) while the host renames
and mounts: openat2 answers EAGAIN to a `..` resolved meanwhile, and a read must not fail for it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from services.sandbox.isolation import beneath
from services.sandbox.isolation.beneath import Root


def reads_during_renames(root: Path, reads: int, *, until_an_error: bool = False) -> list[str]:
    """Read `calc/../calc/ops.py` `reads` times (or until one fails) while another thread renames a file
    elsewhere without pause (any rename on the host moves the kernel's rename sequence); the errors."""
    (root / "calc").mkdir()
    (root / "calc" / "ops.py").write_text("x = 1\n")
    elsewhere = root.parent / f"{root.name}-renames"
    elsewhere.mkdir()
    (elsewhere / "a").touch()
    stop = threading.Event()

    def rename_forever() -> None:
        names = [elsewhere / "a", elsewhere / "b"]
        while not stop.is_set():
            os.rename(names[0], names[1])
            names.reverse()

    renamer = threading.Thread(target=rename_forever)
    renamer.start()
    errors = []
    try:
        for _ in range(reads):
            try:
                Root(root).read_bytes("calc/../calc/ops.py", limit=100)
            except OSError as exc:
                errors.append(repr(exc))
                if until_an_error:
                    break
    finally:
        stop.set()
        renamer.join()
    return errors


def test_a_dotdot_read_is_retried_while_the_host_renames(tmp_path: Path) -> None:
    root = tmp_path / "workspace"
    root.mkdir()
    assert reads_during_renames(root, 10_000) == []  # one try each: about 1 in 1,000 meets EAGAIN


def test_without_retries_the_same_reads_meet_eagain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: one try per open, and the kernel's EAGAIN reaches the caller."""
    monkeypatch.setattr(beneath, "_EAGAIN_TRIES", 1)
    root = tmp_path / "workspace"
    root.mkdir()
    errors = reads_during_renames(root, 1_000_000, until_an_error=True)
    assert errors and all("Resource temporarily unavailable" in e for e in errors)
