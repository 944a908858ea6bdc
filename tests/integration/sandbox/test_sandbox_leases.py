"""Leases in real Redis: they mirror each replica's registry, so a flush of Redis costs no live session;
a replica that died without closing leaks nothing once it restarts, or once a live replica finds its
lock free."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from pathlib import Path

import pytest
from sandbox_archives_integration import tar_gz

from crucible.contracts import keys
from crucible.contracts.messages import ObjectRef
from crucible.localstack.servers import start_redis
from services.sandbox.isolation import mounts
from services.sandbox.isolation.cgroups import Cgroups
from services.sandbox.leases import Leases
from services.sandbox.manager import SessionManager
from services.sandbox.settings import Settings

pytestmark = pytest.mark.integration
ARCHIVE = tar_gz({"calc/ops.py": "def add(a, b):\n    return a - b\n"})
REF = ObjectRef(uri="s3://test/calc.tar.gz", sha256=hashlib.sha256(ARCHIVE).hexdigest(), size=len(ARCHIVE))


async def fetch(ref: ObjectRef) -> bytes:
    return ARCHIVE


@pytest.fixture
async def replica_manager(sandbox_root, redis_client):
    """Factory: a started SessionManager for `replica` with Redis leases; all closed at the end."""
    made: list[SessionManager] = []

    async def start(replica: str, **overrides) -> SessionManager:
        settings = Settings(workspace_root=sandbox_root, replica=replica, reap_interval_s=0.2, **overrides)
        manager = SessionManager(settings=settings, fetch=fetch, leases=Leases(redis_client, replica=replica))
        await manager.start()
        made.append(manager)
        return manager

    yield start
    for manager in made:
        if not manager.closing:
            await manager.close()


def leftovers(root: Path, replica: str) -> dict[str, object]:
    where = Cgroups.locate(replica)
    return {
        "mounts": mounts.mounted_under(root / replica) if (root / replica).exists() else [],
        "folder": (root / replica).exists(),
        "cgroups": [d for d in (where[0].values() if where else []) if d.exists()],
    }


@pytest.fixture
async def own_redis(tmp_path):
    """A Redis of this test's own, which it may flush."""
    import redis.asyncio as aioredis

    server = start_redis(state_dir=tmp_path)
    client = aioredis.from_url(server.url)
    yield client
    await client.aclose()
    server.stop()


async def test_a_redis_flush_costs_no_live_session_and_the_leases_come_back(sandbox_root, own_redis):
    name = f"flush-{uuid.uuid4().hex[:6]}"
    settings = Settings(workspace_root=sandbox_root, replica=name, reap_interval_s=0.2)
    manager = SessionManager(settings=settings, fetch=fetch, leases=Leases(own_redis, replica=name))
    peer_name = f"peer-{uuid.uuid4().hex[:6]}"
    peer_settings = Settings(workspace_root=sandbox_root, replica=peer_name, reap_interval_s=0.2)
    peer = SessionManager(settings=peer_settings, fetch=fetch, leases=Leases(own_redis, replica=peer_name))
    await manager.start()
    await peer.start()
    try:
        sessions = [await manager.create(run_id="r", task_id="t", snapshot=REF, ttl_s=60) for _ in range(2)]
        assert await own_redis.flushall() is True  # every lease and set gone, as after a failover
        assert await manager.reap() == 0  # no session is reaped for it...
        assert set(manager.sessions) == {s.id for s in sessions}
        for session in sessions:  # ...and the leases are back, for the time each session has left
            assert await own_redis.get(keys.sandbox_lease_key(session.id)) == name.encode()
            assert 50_000 < await own_redis.pttl(keys.sandbox_lease_key(session.id)) <= 60_000
        members = await own_redis.smembers(keys.sandbox_sessions_key(name))
        assert members == {s.id.encode() for s in sessions}
        assert await peer.sweep_dead_replicas() == []  # a live replica is never taken for a dead one
        assert all(s.workspace.root.exists() for s in sessions)
        assert await sessions[0].exclusive(lambda: asyncio.sleep(0, "served")) == "served"  # still in use
    finally:
        await peer.close()
        await manager.close()


async def test_a_session_idle_past_its_ttl_is_reaped_and_its_lease_dropped(replica_manager, redis_client):
    manager = await replica_manager(f"lease-{uuid.uuid4().hex[:6]}")
    kept = await manager.create(run_id="r", task_id="t", snapshot=REF, ttl_s=60)
    lapsed = await manager.create(run_id="r", task_id="t", snapshot=REF, ttl_s=0.5)
    key = keys.sandbox_lease_key(lapsed.id)
    assert await redis_client.get(key) == manager.settings.replica.encode()
    assert 0 < await redis_client.pttl(key) <= 500
    assert await _eventually(manager.reap, lambda reaped: reaped == 1)  # no call since: its TTL passed
    assert set(manager.sessions) == {kept.id}
    assert not lapsed.workspace.root.exists() and not await redis_client.exists(key)
    members = await redis_client.smembers(keys.sandbox_sessions_key(manager.settings.replica))
    assert members == {kept.id.encode()}


async def test_a_restarted_replica_releases_what_its_crashed_run_held(
    replica_manager, sandbox_root, redis_client
):
    replica = f"crash-{uuid.uuid4().hex[:6]}"
    crashed = await replica_manager(replica)
    sessions = [await crashed.create(run_id="r", task_id="t", snapshot=REF, ttl_s=60) for _ in range(3)]
    job = sessions[0].jobs[await sessions[0].start_job("sleep 300")]
    crashed.closing = True  # never closed: its mounts, folders, cgroups, leases and a job stay behind
    crashed.lock.release()  # as the kernel does when its process dies
    before = leftovers(sandbox_root, replica)
    assert before["folder"] and (before["mounts"] or not crashed.privileged)

    restarted = await replica_manager(replica)
    after = leftovers(sandbox_root, replica)
    assert after["mounts"] == [m for m in after["mounts"] if "sessions" not in str(m)]
    assert not list((sandbox_root / replica / "sessions").iterdir())
    for session in sessions:
        assert not await redis_client.exists(keys.sandbox_lease_key(session.id))
    if crashed.cgroups is not None:  # its cgroup was swept, and every process in it killed
        assert await asyncio.wait_for(job.proc.wait(), 10) != 0
    assert restarted.sessions == {}
    await restarted.close()
    assert leftovers(sandbox_root, replica) == {"mounts": [], "folder": False, "cgroups": []}


async def test_a_dead_replicas_leftovers_are_swept_by_a_live_one(replica_manager, sandbox_root, redis_client):
    dead_name = f"dead-{uuid.uuid4().hex[:6]}"
    dead = await replica_manager(dead_name)
    await dead.create(run_id="r", task_id="t", snapshot=REF, ttl_s=60)
    live = await replica_manager(f"live-{uuid.uuid4().hex[:6]}")
    assert await live.sweep_dead_replicas() == []  # its process still holds its lock
    dead.closing = True
    dead.lock.release()  # as the kernel does when its process dies
    assert await live.sweep_dead_replicas() == [dead_name]
    assert leftovers(sandbox_root, dead_name) == {"mounts": [], "folder": False, "cgroups": []}


async def test_calls_renew_the_lease_without_waiting_for_redis(replica_manager, redis_client):
    manager = await replica_manager(f"renew-{uuid.uuid4().hex[:6]}")
    session = await manager.create(run_id="r", task_id="t", snapshot=REF, ttl_s=2)
    key = keys.sandbox_lease_key(session.id)
    await asyncio.sleep(0.6)
    assert await redis_client.pttl(key) <= 1500
    manager.get(session.id)  # a call on the session: more than a tenth of the TTL since the last renewal
    assert await _eventually(lambda: redis_client.pttl(key), lambda ttl: ttl > 1800)
    await asyncio.sleep(0.1)
    manager.get(session.id)  # again at once: throttled, the lease is not extended
    await asyncio.sleep(0.1)
    assert await redis_client.pttl(key) <= 1850
    await asyncio.sleep(2.2)
    assert await manager.reap() == 1  # no call since: it lapses and is reaped
    assert manager.sessions == {}


async def _eventually(read, ok, *, timeout_s: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if ok(await read()):
            return True
        await asyncio.sleep(0.02)
    return False
