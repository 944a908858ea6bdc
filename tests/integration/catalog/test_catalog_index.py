"""Sampling and look-ups on the task index, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from random import Random

import pytest

from crucible.bus import RequestError
from services.catalog.index import get_task, sample_tasks, upsert_tasks

pytestmark = pytest.mark.integration


def _row(task_id: str, difficulty: int, *, taskset: str = "toy") -> dict:
    ref = {"uri": f"s3://b/tasksets/{taskset}/{task_id}/repo.tar.gz", "sha256": "0" * 64, "size": 10}
    return {
        "task_id": task_id,
        "taskset": taskset,
        "difficulty": difficulty,
        "family": "stats",
        "statement": f"statement of {task_id}",
        "snapshot": ref,
        "hidden_tests": {**ref, "size": 5},
        "test_command": ["python", "-m", "pytest"],
        "reference_patch": "diff",
        "created_at": datetime.now(UTC),
    }


@pytest.fixture
async def session(sessionmaker):
    rows = [_row(f"toy-d{d}-{i}", d) for d in (1, 2) for i in range(3)] + [
        _row("other-d3-0", 3, taskset="other")
    ]
    async with sessionmaker() as session:
        async with session.begin():
            await upsert_tasks(session=session, rows=rows)
            await upsert_tasks(session=session, rows=[{**rows[0], "statement": "rewritten"}])
        yield session


async def test_seeded_sampling_is_repeatable_and_filters_levels(session):
    draw = await sample_tasks(session=session, taskset="toy", count=3, difficulties=[2], rng=Random(9))
    again = await sample_tasks(session=session, taskset="toy", count=3, difficulties=[2], rng=Random(9))
    assert [t.task_id for t in draw] == [t.task_id for t in again]
    assert sorted(t.task_id for t in draw) == ["toy-d2-0", "toy-d2-1", "toy-d2-2"]
    assert all(t.difficulty == 2 and t.taskset == "toy" for t in draw)


async def test_more_than_the_pool_repeats_every_task_evenly(session):
    draw = await sample_tasks(session=session, taskset="toy", count=14, difficulties=None, rng=Random(1))
    counts = Counter(t.task_id for t in draw)
    assert len(counts) == 6 and set(counts.values()) <= {2, 3}


async def test_clear_errors(session):
    with pytest.raises(RequestError) as unknown:
        await sample_tasks(session=session, taskset="nope", count=1, difficulties=None, rng=Random(0))
    assert unknown.value.code == "unknown_taskset"
    with pytest.raises(RequestError) as empty:
        await sample_tasks(session=session, taskset="toy", count=1, difficulties=[3], rng=Random(0))
    assert empty.value.code == "empty_selection" and "[1, 2]" in empty.value.detail
    for count, levels in ((0, None), (1, [])):
        with pytest.raises(RequestError) as bad:
            await sample_tasks(
                session=session, taskset="toy", count=count, difficulties=levels, rng=Random(0)
            )
        assert bad.value.code == "bad_request"
    with pytest.raises(RequestError) as missing:
        await get_task(session=session, task_id="toy-d9-9", include_secret=False)
    assert missing.value.code == "not_found"


async def test_get_returns_the_secret_only_when_asked(session):
    public = await get_task(session=session, task_id="toy-d1-0", include_secret=False)
    assert public.secret is None and public.task.statement == "rewritten"
    full = await get_task(session=session, task_id="toy-d1-0", include_secret=True)
    assert full.secret is not None and full.secret.hidden_tests.size == 5
    assert full.secret.test_command == ["python", "-m", "pytest"] and full.secret.reference_patch == "diff"
