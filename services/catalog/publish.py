"""Make a generated task set available: generate, verify, upload the archives, index the rows.

Idempotent and safe to run from several replicas at once: archives are reproducible, so a task
whose stored row and objects already match what the generator produces is reused without being
verified again; everything else is verified, uploaded under fixed keys and upserted. Rows of the set
that the generator no longer produces, or that failed verification, are removed, so they are never
served.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from crucible.contracts.keys import taskset_object
from crucible.objectstore import ObjectStore
from services.catalog.generator import GeneratedTask, generate_taskset
from services.catalog.index import delete_tasks_except, stored_rows, upsert_tasks
from services.catalog.snapshots import tarball
from services.catalog.verify import VerifyResult, verify_task


@dataclass(frozen=True, kw_only=True)
class PublishReport:
    taskset: str
    generated: int
    reused: int
    published: int
    removed: int
    rejected: dict[str, str] = field(default_factory=dict)
    """task_id -> why verification refused it."""


@dataclass(frozen=True, kw_only=True)
class _Packed:
    task: GeneratedTask
    repo: bytes
    hidden: bytes
    row: dict[str, Any]


async def publish_taskset(
    *,
    name: str,
    seed: int,
    per_difficulty: int,
    difficulties: tuple[int, ...],
    store: ObjectStore,
    sessionmaker: async_sessionmaker[AsyncSession],
    workers: int = 2,
    timeout: float = 60.0,
    on_rejected: Callable[[VerifyResult], None] | None = None,
) -> PublishReport:
    tasks = await asyncio.to_thread(
        generate_taskset, seed=seed, per_difficulty=per_difficulty, difficulties=difficulties, taskset=name
    )
    packed = [_pack(task, store=store) for task in tasks]
    async with sessionmaker() as session:
        stored = await stored_rows(session=session, taskset=name)
    current = [p for p in packed if stored.get(p.task.task_id) == p.row and await _objects_exist(store, p)]
    reused = {p.task.task_id for p in current}
    todo = [p for p in packed if p.task.task_id not in reused]
    results = await _verify_all([p.task for p in todo], workers=workers, timeout=timeout)
    rejected = {r.task_id: r.reason for r in results if not r.ok}
    if on_rejected is not None:
        for result in results:
            if not result.ok:
                on_rejected(result)
    fresh = [p for p in todo if p.task.task_id not in rejected]
    for p in fresh:
        await store.put_bytes(
            taskset_object(name, p.task.task_id, "repo.tar.gz"), p.repo, content_type="application/gzip"
        )
        await store.put_bytes(
            taskset_object(name, p.task.task_id, "hidden.tar.gz"), p.hidden, content_type="application/gzip"
        )
    now = datetime.now(UTC)
    async with sessionmaker() as session, session.begin():
        await upsert_tasks(
            session=session, rows=[{"task_id": p.task.task_id, **p.row, "created_at": now} for p in fresh]
        )
        keep = {p.task.task_id for p in current + fresh}
        removed = await delete_tasks_except(session=session, taskset=name, keep=keep)
    return PublishReport(
        taskset=name,
        generated=len(packed),
        reused=len(current),
        published=len(fresh),
        removed=removed,
        rejected=rejected,
    )


def _ref(store: ObjectStore, key: str, data: bytes) -> dict[str, Any]:
    return {"uri": store.uri(key), "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def _pack(task: GeneratedTask, *, store: ObjectStore) -> _Packed:
    repo, hidden = tarball(task.files), tarball(task.hidden_files)
    row = {
        "taskset": task.taskset,
        "difficulty": task.difficulty,
        "family": task.family,
        "statement": task.statement,
        "snapshot": _ref(store, taskset_object(task.taskset, task.task_id, "repo.tar.gz"), repo),
        "hidden_tests": _ref(store, taskset_object(task.taskset, task.task_id, "hidden.tar.gz"), hidden),
        "test_command": list(task.test_command),
        "reference_patch": task.reference_patch,
    }
    return _Packed(task=task, repo=repo, hidden=hidden, row=row)


async def _objects_exist(store: ObjectStore, p: _Packed) -> bool:
    keys = [taskset_object(p.task.taskset, p.task.task_id, name) for name in ("repo.tar.gz", "hidden.tar.gz")]
    return all([await store.exists(key) for key in keys])


async def _verify_all(tasks: list[GeneratedTask], *, workers: int, timeout: float) -> list[VerifyResult]:
    if not tasks:
        return []
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="catalog-verify") as pool:
        verify = functools.partial(verify_task, timeout=timeout)
        return list(await asyncio.gather(*(loop.run_in_executor(pool, verify, task) for task in tasks)))
