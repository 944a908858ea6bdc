"""The catalog's task index in the database: upserts, sampling and look-ups."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from random import Random
from typing import Any, cast

import msgspec
from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.bus import RequestError
from crucible.contracts.messages import Expected, ObjectRef, TaskReply, TaskSecret, TaskSpec
from crucible.db.models import Task
from crucible.db.task_records import TaskRecord, task_records

_UPSERT_BATCH = 200
ROW_FIELDS = (
    "taskset",
    "split",
    "source",
    "repo",
    "difficulty",
    "family",
    "statement",
    "snapshot",
    "hidden_tests",
    "test_command",
    "reference_patch",
    "fail_to_pass",
    "pass_to_pass",
    "probes",
)


async def stored_rows(*, session: AsyncSession, taskset: str) -> dict[str, dict[str, Any]]:
    """task_id -> the row's fields (ROW_FIELDS) for every task of the set."""
    rows = (await session.scalars(select(Task).where(Task.taskset == taskset))).all()
    return {row.task_id: {name: getattr(row, name) for name in ROW_FIELDS} for row in rows}


async def upsert_tasks(*, session: AsyncSession, rows: Sequence[dict[str, Any]]) -> None:
    """Insert tasks, or overwrite them in place; concurrent replicas writing the same rows is harmless."""
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    insert = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}.get(dialect)
    if insert is None:
        raise NotImplementedError(f"the catalog index does not support {dialect}")
    for start in range(0, len(rows), _UPSERT_BATCH):
        statement = insert(Task).values(list(rows[start : start + _UPSERT_BATCH]))
        statement = statement.on_conflict_do_update(
            index_elements=[Task.task_id], set_={name: statement.excluded[name] for name in ROW_FIELDS}
        )
        await session.execute(statement)


async def delete_tasks_except(*, session: AsyncSession, taskset: str, keep: Collection[str]) -> int:
    result = await session.execute(delete(Task).where(Task.taskset == taskset, Task.task_id.not_in(keep)))
    return cast(CursorResult[Any], result).rowcount  # a DML statement's result is a CursorResult


async def sample_tasks(
    *,
    session: AsyncSession,
    taskset: str,
    count: int,
    difficulties: Sequence[int] | None,
    rng: Random,
    split: str = "train",
    sampling: str = "uniform",
    run_id: str = "",
) -> list[TaskSpec]:
    """`count` tasks of one split drawn at random: without repeats while the selection lasts, then round
    after round. `learnable` (train split only) weighs each task by its recent pass rate in `run_id`
    (`learnable_weight`)."""
    if count < 1:
        raise RequestError("bad_request", f"count must be at least 1, got {count}")
    if difficulties is not None and not difficulties:
        raise RequestError("bad_request", "difficulties must be omitted or list at least one level")
    found = (
        await session.execute(
            select(Task.task_id, Task.difficulty, Task.split).where(Task.taskset == taskset)
        )
    ).all()
    if not found:
        raise RequestError("unknown_taskset", f"no task set named {taskset!r}")
    in_split = [(task_id, level) for task_id, level, task_split in found if task_split == split]
    if not in_split:
        splits = sorted({task_split for _, _, task_split in found})
        raise RequestError("empty_selection", f"task set {taskset!r} has no {split} task; it has {splits}")
    pool = sorted(task_id for task_id, level in in_split if difficulties is None or level in difficulties)
    if not pool:
        levels = sorted({level for _, level in in_split})
        raise RequestError(
            "empty_selection",
            f"task set {taskset!r} has no {split} task at difficulties {list(difficulties or [])}; "
            f"it has {levels}",
        )
    weights = [1.0] * len(pool)
    if sampling == "learnable":
        if split != "train":
            raise RequestError("bad_request", f"learnable sampling draws from the train split, not {split!r}")
        records = {r.task_id: r for r in await task_records(session, run_id)}
        weights = [learnable_weight(records.get(task_id)) for task_id in pool]
    chosen: list[str] = []
    while len(chosen) < count:
        chosen += _draw(pool, weights, min(len(pool), count - len(chosen)), rng)
    rows = (await session.scalars(select(Task).where(Task.task_id.in_(set(chosen))))).all()
    by_id = {row.task_id: row for row in rows}
    return [task_spec(by_id[task_id]) for task_id in chosen]


LEARNED_WEIGHT = 0.1
"""A task the run always or never resolves, against 1 for one it resolves half the time (or never tried):
rarely drawn, since its group's rewards are all equal and it teaches nothing, but not never, since the
policy changes."""


def learnable_weight(record: TaskRecord | None) -> float:
    """How much a run should want a task next: 4 p (1 - p) for a recent pass rate p (1 at p = 1/2, where a
    group's rewards differ the most), at least LEARNED_WEIGHT; 1 for a task it has not tried."""
    if record is None or not record.recent_attempts:
        return 1.0
    p = record.pass_rate
    return max(4.0 * p * (1.0 - p), LEARNED_WEIGHT)


def _draw(pool: list[str], weights: list[float], k: int, rng: Random) -> list[str]:
    """`k` distinct tasks, each draw in proportion to the weights of those left."""
    if len(set(weights)) == 1:
        return rng.sample(pool, k=k)
    left = dict(zip(pool, weights, strict=True))
    drawn = []
    for _ in range(k):
        (task,) = rng.choices(list(left), weights=list(left.values()))
        drawn.append(task)
        del left[task]
    return drawn


async def list_tasks(*, session: AsyncSession, taskset: str, split: str, limit: int) -> list[TaskSpec]:
    """The first `limit` tasks of one split, in task id order."""
    if limit < 1:
        raise RequestError("bad_request", f"limit must be at least 1, got {limit}")
    rows = (
        await session.scalars(
            select(Task)
            .where(Task.taskset == taskset, Task.split == split)
            .order_by(Task.task_id)
            .limit(limit)
        )
    ).all()
    if not rows:
        raise RequestError("empty_selection", f"task set {taskset!r} has no {split} task")
    return [task_spec(row) for row in rows]


async def describe_taskset(*, session: AsyncSession, taskset: str) -> dict[str, list[int]]:
    """Each split of a task set with the difficulties it has tasks of, ascending."""
    rows = await session.execute(
        select(Task.split, Task.difficulty)
        .where(Task.taskset == taskset)
        .distinct()
        .order_by(Task.difficulty)
    )
    out: dict[str, list[int]] = {}
    for split, difficulty in rows:
        out.setdefault(split, []).append(difficulty)
    return out


async def get_task(*, session: AsyncSession, task_id: str, include_secret: bool) -> TaskReply:
    row = await session.get(Task, task_id)
    if row is None:
        raise RequestError("not_found", f"no task {task_id!r}")
    secret = task_secret(row) if include_secret else None
    return TaskReply(task=task_spec(row), secret=secret)


def task_spec(row: Task) -> TaskSpec:
    return TaskSpec(
        task_id=row.task_id,
        taskset=row.taskset,
        difficulty=row.difficulty,
        statement=row.statement,
        snapshot=ObjectRef(**row.snapshot),
        split=row.split,
    )


def task_secret(row: Task) -> TaskSecret:
    return TaskSecret(
        task_id=row.task_id,
        hidden_tests=ObjectRef(**row.hidden_tests),
        test_command=list(row.test_command),
        reference_patch=row.reference_patch,
        fail_to_pass=list(row.fail_to_pass),
        pass_to_pass=list(row.pass_to_pass),
        probes=msgspec.convert(row.probes or {}, dict[str, Expected]),
    )
