"""Publishing task sets into a real object store and database (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from sqlalchemy import func, select

from crucible.contracts.messages import ObjectRef
from crucible.db.models import Task
from services.catalog.generator import HIDDEN_TESTS, generate_taskset
from services.catalog.publish import publish_taskset
from services.catalog.snapshots import untar

pytestmark = pytest.mark.integration


async def _publish(store, sessionmaker, **overrides):
    args = {"name": "pybugs", "seed": 4, "per_difficulty": 1, "difficulties": (1,), "timeout": 60.0}
    return await publish_taskset(store=store, sessionmaker=sessionmaker, **{**args, **overrides})


async def _rows(sessionmaker) -> list[Task]:
    async with sessionmaker() as session:
        return list((await session.scalars(select(Task).order_by(Task.task_id))).all())


async def test_concurrent_replicas_publish_once_and_a_restart_reuses(store, sessionmaker):
    first, second = await asyncio.gather(_publish(store, sessionmaker), _publish(store, sessionmaker))
    assert first.published == second.published == 1 and not first.rejected
    rows = await _rows(sessionmaker)
    assert [r.task_id for r in rows] == ["pybugs-d1-0000"]

    again = await _publish(store, sessionmaker)
    assert (again.reused, again.published, again.removed) == (1, 0, 0)

    generated = generate_taskset(seed=4, per_difficulty=1, difficulties=(1,))[0]
    row = rows[0]
    assert row.statement == generated.statement and row.reference_patch == generated.reference_patch
    repo = await store.get_bytes(ObjectRef(**row.snapshot))
    hidden = await store.get_bytes(ObjectRef(**row.hidden_tests))
    assert row.snapshot["sha256"] == hashlib.sha256(repo).hexdigest()
    assert untar(repo) == generated.files and untar(hidden) == generated.hidden_files
    assert list(untar(hidden)) == [HIDDEN_TESTS]
    assert row.snapshot["uri"].endswith("/tasksets/pybugs/pybugs-d1-0000/repo.tar.gz")


async def test_a_new_seed_replaces_and_a_smaller_set_removes(store, sessionmaker):
    await _publish(store, sessionmaker, per_difficulty=2)
    before = {r.task_id: r.statement for r in await _rows(sessionmaker)}
    report = await _publish(store, sessionmaker, seed=5, per_difficulty=1)
    after = {r.task_id: r.statement for r in await _rows(sessionmaker)}
    assert (report.published, report.removed) == (1, 1)
    assert list(after) == ["pybugs-d1-0000"] and after["pybugs-d1-0000"] != before["pybugs-d1-0000"]


async def test_tasks_that_fail_verification_are_never_indexed(store, sessionmaker):
    refused = []
    report = await _publish(store, sessionmaker, timeout=0.001, on_rejected=refused.append)
    assert report.published == 0 and list(report.rejected) == ["pybugs-d1-0000"]
    assert [r.task_id for r in refused] == ["pybugs-d1-0000"] and "ran past" in refused[0].reason
    async with sessionmaker() as session:
        assert await session.scalar(select(func.count()).select_from(Task)) == 0
    assert await store.list("tasksets/") == []
