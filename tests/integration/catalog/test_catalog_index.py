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


RUN = "run-learnable"
# (task, resolved episodes of four): always, never, half; the d2 tasks the run has not tried
RECORD = {"toy-d1-0": 4, "toy-d1-1": 0, "toy-d1-2": 2}


async def _graded(session, task_id: str, i: int, resolved: bool, *, eval_id: str | None = None) -> None:
    from crucible.db.models import Trajectory

    session.add(Trajectory(
        trajectory_id=f"{task_id}-{eval_id or 'train'}-{i}", run_id=RUN, group_id="g", task_id=task_id,
        taskset="toy", reward=float(resolved), tests_passed=int(resolved), tests_total=1,
        reward_components={}, resolved=resolved, eval_id=eval_id, finish_reason="submitted",
        num_tokens=10, version_min=0, version_max=0, tool_calls=[], payload=b"",
        graded_at=datetime(2026, 1, 1, 0, 0, i, tzinfo=UTC),
    ))  # fmt: skip


@pytest.fixture
async def learning(session):
    from crucible.db.models import Run

    async with session.begin():
        await upsert_tasks(session=session, rows=[{**_row("toy-held-0", 1), "split": "test"}])
        session.add(Run(run_id=RUN, name="learnable", config={}))
        await session.flush()
        for task_id, passes in RECORD.items():
            for i in range(4):
                await _graded(session, task_id, i, i < passes)
        for i in range(4):  # an evaluation's episodes are not the run's record: never resolved here
            await _graded(session, "toy-d1-0", i, False, eval_id="eval-1")
    return session


async def test_a_runs_record_counts_its_training_episodes_per_task(learning):
    from crucible.db.task_records import task_records

    records = {r.task_id: r for r in await task_records(learning, RUN)}
    assert {t: (r.attempts, r.resolved, r.pass_rate) for t, r in records.items()} == {
        "toy-d1-0": (4, 4, 1.0), "toy-d1-1": (4, 0, 0.0), "toy-d1-2": (4, 2, 0.5),
    }  # fmt: skip
    assert [r.task_id for r in await task_records(learning, RUN, after="toy-d1-0", limit=1)] == ["toy-d1-1"]


async def test_learnable_sampling_prefers_tasks_resolved_sometimes_and_never_draws_held_out(learning):
    drawn: Counter[str] = Counter()
    for seed in range(200):  # as the rollouts ask: one task per group, a seed each
        (task,) = await sample_tasks(
            session=learning, taskset="toy", count=1, difficulties=None, rng=Random(seed),
            sampling="learnable", run_id=RUN,
        )  # fmt: skip
        drawn[task.task_id] += 1
    assert set(drawn) <= {f"toy-d{d}-{i}" for d in (1, 2) for i in range(3)}  # the train split alone
    # weights: half 1, always 0.1, never 0.1, each untried 1 (of 4.2): ~48, ~5, ~5, ~48 each
    assert drawn["toy-d1-2"] > 4 * max(drawn["toy-d1-0"], drawn["toy-d1-1"])
    assert all(drawn[f"toy-d2-{i}"] > 4 * max(drawn["toy-d1-0"], drawn["toy-d1-1"]) for i in range(3))
    assert drawn["toy-d1-0"] > 0 and drawn["toy-d1-1"] > 0  # rarely, not never: the policy changes
    uniform: Counter[str] = Counter()
    for seed in range(100):
        (task,) = await sample_tasks(
            session=learning, taskset="toy", count=1, difficulties=None, rng=Random(seed), run_id=RUN
        )
        uniform[task.task_id] += 1
    assert min(uniform.values()) > 8  # uniform sampling ignores the record
    with pytest.raises(RequestError, match="train split"):
        await sample_tasks(
            session=learning, taskset="toy", count=1, difficulties=None, rng=Random(0),
            split="test", sampling="learnable", run_id=RUN,
        )  # fmt: skip
