"""Make task sets available: archives to the object store, rows to the index, in that order, so a row is
never served before its files exist.

`store_tasks` does it for verified tasks of any source (generated, imported, synthesized).
`publish_taskset` is the built-in generated set: idempotent and safe to run from several replicas at
once. Archives are reproducible, so a task whose stored row and objects already match what the
generator produces is reused without being verified again; everything else is verified, uploaded
under fixed keys and upserted. Rows of the set that the generator no longer produces, or that failed
verification, are removed, so they are never served.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from crucible.contracts.keys import taskset_object
from crucible.contracts.messages import Expected
from crucible.objectstore import ObjectStore
from services.catalog.generator import GeneratedTask, generate_taskset
from services.catalog.index import delete_tasks_except, stored_rows, upsert_tasks
from services.catalog.snapshots import tarball
from services.catalog.verify import VerifyResult, verify_task

SNAPSHOT, HIDDEN = "repo.tar.gz", "hidden.tar.gz"


@dataclass(frozen=True, kw_only=True)
class TaskRecord:
    """One verified task as the index serves it, whatever made it: its two archives and its row."""

    task_id: str
    taskset: str
    split: str
    source: str
    repo: str = ""
    difficulty: int
    family: str
    statement: str
    snapshot: bytes
    """tar.gz of the repository the agent starts from."""
    hidden: bytes
    """tar.gz of the test files laid over it before grading."""
    test_command: tuple[str, ...]
    reference_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    probes: Mapping[str, Expected] = field(default_factory=dict)
    """Generated tasks: what each hidden probe test must give (crucible.probes)."""

    def row(self, store: ObjectStore) -> dict[str, Any]:
        return {
            "taskset": self.taskset,
            "split": self.split,
            "source": self.source,
            "repo": self.repo,
            "difficulty": self.difficulty,
            "family": self.family,
            "statement": self.statement,
            "snapshot": _ref(store, taskset_object(self.taskset, self.task_id, SNAPSHOT), self.snapshot),
            "hidden_tests": _ref(store, taskset_object(self.taskset, self.task_id, HIDDEN), self.hidden),
            "test_command": list(self.test_command),
            "reference_patch": self.reference_patch,
            "fail_to_pass": list(self.fail_to_pass),
            "pass_to_pass": list(self.pass_to_pass),
            "probes": msgspec.to_builtins(dict(self.probes)),
        }


async def store_tasks(
    records: Sequence[TaskRecord],
    *,
    store: ObjectStore,
    sessionmaker: async_sessionmaker[AsyncSession],
    replace: str | None = None,
    keep: Set[str] = frozenset(),
    upload: bool = True,
) -> int:
    """Upload the records' archives (unless already there: `upload=False`), then index them in one
    transaction. With `replace` (a task set's name), the set's other rows, but those in `keep`, are
    removed. Returns how many rows were removed."""
    for record in records if upload else ():
        for name, data in ((SNAPSHOT, record.snapshot), (HIDDEN, record.hidden)):
            key = taskset_object(record.taskset, record.task_id, name)
            await store.put_bytes(key, data, content_type="application/gzip")
    now = datetime.now(UTC)
    async with sessionmaker() as session, session.begin():
        await upsert_tasks(
            session=session,
            rows=[{"task_id": r.task_id, **r.row(store), "created_at": now} for r in records],
        )
        if replace is None:
            return 0
        kept = keep | {r.task_id for r in records}
        return await delete_tasks_except(session=session, taskset=replace, keep=kept)


@dataclass(frozen=True, kw_only=True)
class PublishReport:
    taskset: str
    generated: int
    reused: int
    published: int
    removed: int
    rejected: dict[str, str] = field(default_factory=dict)
    """task_id -> why verification refused it."""


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
    by_id = {task.task_id: task for task in tasks}
    records = [generated_record(task) for task in tasks]
    async with sessionmaker() as session:
        stored = await stored_rows(session=session, taskset=name)
    current = {
        r.task_id for r in records if stored.get(r.task_id) == r.row(store) and await _objects_exist(store, r)
    }
    todo = [r for r in records if r.task_id not in current]
    results = await _verify_all([by_id[r.task_id] for r in todo], workers=workers, timeout=timeout)
    rejected = {r.task_id: r.reason for r in results if not r.ok}
    if on_rejected is not None:
        for result in results:
            if not result.ok:
                on_rejected(result)
    fresh = [r for r in todo if r.task_id not in rejected]
    removed = await store_tasks(fresh, store=store, sessionmaker=sessionmaker, replace=name, keep=current)
    return PublishReport(
        taskset=name,
        generated=len(records),
        reused=len(current),
        published=len(fresh),
        removed=removed,
        rejected=rejected,
    )


def generated_record(task: GeneratedTask) -> TaskRecord:
    return TaskRecord(
        task_id=task.task_id,
        taskset=task.taskset,
        split=task.split,
        source="generated",
        difficulty=task.difficulty,
        family=task.family,
        statement=task.statement,
        snapshot=tarball(task.files),
        hidden=tarball(task.hidden_files),
        test_command=task.test_command,
        reference_patch=task.reference_patch,
        fail_to_pass=task.fail_to_pass,
        pass_to_pass=task.pass_to_pass,
        probes=task.probes,
    )


def _ref(store: ObjectStore, key: str, data: bytes) -> dict[str, Any]:
    return {"uri": store.uri(key), "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


async def _objects_exist(store: ObjectStore, record: TaskRecord) -> bool:
    keys = [taskset_object(record.taskset, record.task_id, name) for name in (SNAPSHOT, HIDDEN)]
    return all([await store.exists(key) for key in keys])


async def _verify_all(tasks: list[GeneratedTask], *, workers: int, timeout: float) -> list[VerifyResult]:
    if not tasks:
        return []
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="catalog-verify") as pool:
        verify = functools.partial(verify_task, timeout=timeout)
        return list(await asyncio.gather(*(loop.run_in_executor(pool, verify, task) for task in tasks)))
