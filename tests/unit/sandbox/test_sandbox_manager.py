"""The session manager: capacity, unknown sessions, TTL expiry, shutdown."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from sandbox_archives import REPO, make_tar

from crucible.bus import RequestError
from crucible.contracts.messages import ObjectRef
from services.sandbox.manager import SessionManager
from services.sandbox.settings import Settings


class Archives:
    """Archives by uri, standing in for the object store (the integration tests use a real one)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def add(self, name: str, data: bytes) -> ObjectRef:
        self.data[f"s3://test/{name}"] = data
        return ObjectRef(uri=f"s3://test/{name}", sha256=hashlib.sha256(data).hexdigest(), size=len(data))

    async def fetch(self, ref: ObjectRef) -> bytes:
        return self.data[ref.uri]


@pytest.fixture
def archives():
    return Archives()


@pytest.fixture
async def manager(tmp_path, archives, sandbox):
    settings = Settings(
        workspace_root=tmp_path / "sandboxes", replica="unit", max_sessions=2, reap_interval_s=0.05
    )
    manager = SessionManager(settings=settings, fetch=archives.fetch)
    yield manager
    await manager.close()


async def test_create_get_destroy(manager, archives):
    ref = archives.add("repo.tar.gz", make_tar(REPO))
    session = await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
    assert manager.get(session.id) is session and (session.workspace / "calc/ops.py").exists()
    assert await manager.destroy(session.id) is True
    assert await manager.destroy(session.id) is False
    assert not session.root.exists()
    with pytest.raises(RequestError) as err:
        manager.get(session.id)
    assert err.value.code == "unknown_session"


async def test_busy_when_full(manager, archives):
    ref = archives.add("repo.tar.gz", make_tar(REPO))
    await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
    await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
    with pytest.raises(RequestError) as err:
        await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
    assert err.value.code == "busy"


async def test_bad_snapshot_is_a_clear_error_and_leaves_nothing(manager, archives):
    ref = archives.add("evil.tar.gz", make_tar({"/etc/evil": "x"}))
    with pytest.raises(RequestError) as err:
        await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
    assert err.value.code == "bad_snapshot" and "leaves the archive root" in err.value.detail
    assert (
        manager.sessions == {}
        and [p.name for p in manager.root.iterdir() if not p.name.startswith(".")] == []
    )


async def test_idle_sessions_expire(manager, archives):
    ref = archives.add("repo.tar.gz", make_tar(REPO))
    short = await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=0.2)
    long = await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
    stop = asyncio.Event()
    reaper = asyncio.create_task(manager.reap_loop(stop))
    await asyncio.sleep(0.6)
    stop.set()
    await reaper
    assert list(manager.sessions) == [long.id]
    assert not short.root.exists() and long.root.exists()


async def test_close_destroys_every_session(manager, archives):
    ref = archives.add("repo.tar.gz", make_tar(REPO))
    session = await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
    await manager.close()
    assert manager.sessions == {} and session.closed and not manager.root.exists()


def test_replica_name_must_be_one_subject_token():
    with pytest.raises(ValueError, match="one NATS subject token"):
        Settings(replica="host.example")
