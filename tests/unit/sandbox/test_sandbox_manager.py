"""The session manager: capacity, unknown sessions, TTL expiry, shutdown (on the `manager` fixture of
conftest.py, with room for two sessions and a fast reaper)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import uuid

import pytest
from sandbox_archives import REPO, make_tar

from crucible.bus import RequestError
from services.sandbox.isolation import mounts
from services.sandbox.manager import SessionManager
from services.sandbox.roots import claim_workspace_root, sweep_abandoned_roots
from services.sandbox.settings import Settings


@pytest.fixture
def settings(sandbox_root):
    return Settings(
        workspace_root=sandbox_root,
        replica=f"unit-{uuid.uuid4().hex[:6]}",
        max_sessions=2,
        reap_interval_s=0.05,
    )


async def test_create_get_destroy(manager, archive_ref):
    ref = archive_ref(make_tar(REPO))
    session = await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
    assert manager.get(session.id) is session and (session.workspace.path / "calc/ops.py").exists()
    assert await manager.destroy(session.id) is True
    assert await manager.destroy(session.id) is False
    assert not session.workspace.root.exists()
    with pytest.raises(RequestError) as err:
        manager.get(session.id)
    assert err.value.code == "unknown_session"


async def test_busy_when_full(manager, archive_ref):
    ref = archive_ref(make_tar(REPO))
    await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
    await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
    with pytest.raises(RequestError) as err:
        await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
    assert err.value.code == "busy"


async def test_bad_snapshot_is_a_clear_error_and_leaves_nothing(manager, archive_ref):
    ref = archive_ref(make_tar({"/etc/evil": "x"}))
    with pytest.raises(RequestError) as err:
        await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
    assert err.value.code == "bad_snapshot" and "leaves the archive root" in err.value.detail
    assert manager.sessions == {} and manager.snapshots.ready == {}
    assert list((manager.root / "sessions").iterdir()) == []
    assert list((manager.root / "snapshots").iterdir()) == []


async def test_idle_sessions_expire(manager, archive_ref):
    ref = archive_ref(make_tar(REPO))
    short = await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=0.2)
    long = await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
    stop = asyncio.Event()
    reaper = asyncio.create_task(manager.reap_loop(stop))
    await asyncio.sleep(0.6)
    stop.set()
    await reaper
    assert list(manager.sessions) == [long.id]
    assert not short.workspace.root.exists() and long.workspace.root.exists()


async def test_close_destroys_every_session(manager, archive_ref):
    ref = archive_ref(make_tar(REPO))
    session = await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
    await manager.close()
    assert manager.sessions == {} and session.closed and not manager.root.exists()


def test_replica_name_must_be_one_subject_token():
    with pytest.raises(ValueError, match="one NATS subject token"):
        Settings(replica="host.example")


async def test_a_start_that_fails_leaves_no_mount_or_folder(settings):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    missing = settings.workspace_root / "no-such-folder"
    broken = settings.model_copy(update={"extra_ro_paths": [missing]})
    manager = SessionManager(settings=broken, fetch=None)  # type: ignore[arg-type]  # never fetches
    with pytest.raises(RuntimeError, match="bubblewrap does not work here"):
        await manager.start()
    replica = settings.workspace_root / settings.replica
    assert not replica.exists()
    assert mounts.mounted_under(settings.workspace_root) == []


def test_roots_whose_process_is_gone_are_swept_and_no_others(tmp_path):
    prefix = f"crucible-sweep-{uuid.uuid4().hex[:6]}-"
    ended = subprocess.Popen(["true"])
    ended.wait()
    here = os.stat("/proc/self/ns/pid").st_ino
    abandoned = tmp_path / f"{prefix}{here}.{ended.pid}-a"
    (abandoned / "replica" / "sessions").mkdir(parents=True)
    mounted = mounts.can_mount(tmp_path) and os.geteuid() == 0
    if mounted:
        mounts.tmpfs(abandoned / "replica" / "sessions", size_bytes=2**20, inodes=100)
    held = claim_workspace_root(tmp_path, prefix)  # this process is alive
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / f"{prefix}{here}.{ended.pid}-link"
    link.symlink_to(elsewhere)
    kept = [
        tmp_path / f"{prefix}{here + 1}.{ended.pid}-b",  # another pid namespace: its pids mean nothing here
        tmp_path / f"{prefix}{here}.\u00b2-c",  # not a pid
        tmp_path / f"{prefix}{here}.{2**80}-d",
    ]
    for folder in kept:
        folder.mkdir()
    assert sweep_abandoned_roots(tmp_path, prefix) == [abandoned]
    assert not abandoned.exists() and held.is_dir() and link.is_symlink() and elsewhere.is_dir()
    assert all(folder.is_dir() for folder in kept)
    assert mounts.mounted_under(tmp_path) == []
