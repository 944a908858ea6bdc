from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError, StatementError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import undefer

from crucible.db import make_engine, make_sessionmaker
from crucible.db.migrate import upgrade_async
from crucible.db.models import Checkpoint, Run, Step, Task, Trajectory
from crucible.db.statements import insert_or_ignore

pytestmark = pytest.mark.integration
WHEN = datetime(2026, 3, 1, 12, 30, 15, 123456, tzinfo=UTC)
REF = {"uri": "s3://crucible/tasksets/pybugs/t1.tar.gz", "sha256": "ab" * 32, "size": 1234}


@pytest.fixture
async def session(database_url: str) -> AsyncIterator[AsyncSession]:
    await upgrade_async(database_url)
    engine = make_engine(database_url)
    async with make_sessionmaker(engine)() as session:
        yield session
    await engine.dispose()


def _trajectory(run_id: str) -> Trajectory:
    return Trajectory(
        trajectory_id="t-1",
        run_id=run_id,
        group_id="g-1",
        task_id="pybugs/1",
        taskset="pybugs",
        reward=0.75,
        tests_passed=3,
        tests_total=4,
        reward_components={"tests": 0.75},
        finish_reason="done",
        num_tokens=5,
        version_min=0,
        version_max=2,
        tool_calls=[{"name": "grep", "ok": True}],
        payload=b"\x00\xffpayload",
        graded_count=1,
        graded_at=WHEN,
    )


async def test_rows_round_trip_with_json_bytes_and_utc_times(session: AsyncSession) -> None:
    session.add(Run(run_id="r1", name="demo", config={"seed": 3, "difficulties": [1, 2]}, created_at=WHEN))
    await session.flush()
    session.add_all(
        [
            Step(run_id="r1", step=1, version=0, metrics={"loss": 0.5}, trajectory_ids=["t-1"]),
            _trajectory("r1"),
            Checkpoint(
                run_id="r1", version=1, step=2, manifest_uri="s3://m", num_tensors=7, size_bytes=5 * 2**31
            ),
            Task(
                task_id="pybugs/1",
                taskset="pybugs",
                difficulty=1,
                family="off-by-one",
                statement="fix it",
                snapshot=REF,
                hidden_tests=REF,
                test_command=["pytest", "-q"],
                reference_patch="--- a\n+++ b\n",
            ),
        ]
    )
    await session.commit()
    session.expunge_all()

    run = await session.get(Run, "r1")
    assert run is not None and run.status == "created" and run.config == {"seed": 3, "difficulties": [1, 2]}
    assert run.created_at == WHEN and run.created_at.tzinfo is not None
    traj = await session.scalar(select(Trajectory).options(undefer(Trajectory.payload)))
    assert traj is not None
    assert traj.payload == b"\x00\xffpayload" and traj.graded_at == WHEN
    assert traj.tool_calls == [{"name": "grep", "ok": True}] and traj.reward_components == {"tests": 0.75}
    checkpoint = await session.get(Checkpoint, ("r1", 1))
    assert checkpoint is not None and checkpoint.size_bytes == 5 * 2**31
    task = await session.get(Task, "pybugs/1")
    assert task is not None and task.snapshot == REF and task.test_command == ["pytest", "-q"]


async def test_non_utc_times_are_stored_as_the_same_instant(session: AsyncSession) -> None:
    local = WHEN.astimezone(timezone(timedelta(hours=5)))
    session.add(Run(run_id="r1", name="n", config={}, created_at=local))
    await session.commit()
    session.expunge_all()
    run = await session.get(Run, "r1")
    assert run is not None and run.created_at == WHEN and run.created_at.utcoffset() == timedelta(0)


async def test_naive_timestamps_are_refused(session: AsyncSession) -> None:
    session.add(Run(run_id="r1", name="n", config={}, created_at=datetime(2026, 1, 1)))
    with pytest.raises(StatementError, match="naive datetime"):
        await session.commit()


async def test_insert_or_ignore_reports_whether_it_inserted(session: AsyncSession) -> None:
    assert await insert_or_ignore(session, Run, run_id="r1", name="first", config={})
    assert not await insert_or_ignore(session, Run, run_id="r1", name="second", config={})
    await session.commit()
    assert (await session.get(Run, "r1")).name == "first"  # type: ignore[union-attr]


async def test_foreign_keys_hold_and_cascade(session: AsyncSession) -> None:
    session.add(Step(run_id="nope", step=1, version=0, metrics={}, trajectory_ids=[]))
    with pytest.raises(IntegrityError):
        await session.commit()
    await session.rollback()

    session.add(Run(run_id="r1", name="n", config={}))
    await session.flush()
    session.add_all([Step(run_id="r1", step=1, version=0, metrics={}, trajectory_ids=[]), _trajectory("r1")])
    await session.commit()
    await session.execute(delete(Run).where(Run.run_id == "r1"))
    await session.commit()
    assert (await session.scalars(select(Step))).all() == []
    assert (await session.scalars(select(Trajectory))).all() == []
