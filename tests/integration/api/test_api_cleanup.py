"""A run's trajectory objects (claim checks in the real S3) go once the run has ended and is settled; a
run with work still on the bus keeps them, and the api still serves what it ingested."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import timedelta

import msgspec
import pytest
from httpx import AsyncClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from crucible.bus import Bus
from crucible.contracts import subjects
from crucible.contracts.keys import graded_claim_prefix, run_trajectories_prefix, trajectory_claim_prefix
from crucible.contracts.messages import GradedTrajectory
from crucible.db.models import Run, utcnow
from services.api.cleanup import release_ended_runs
from services.api.ingest import run_ingest

pytestmark = pytest.mark.integration


def big(graded: GradedTrajectory) -> GradedTrajectory:
    """Too big for a message: it travels by claim check."""
    padded = graded.trajectory.final_diff + "+" + "x" * 4096 + "\n"
    return msgspec.structs.replace(
        graded, trajectory=msgspec.structs.replace(graded.trajectory, final_diff=padded)
    )


@pytest.fixture(params=["sqlite"])
def migrated_template(request, sqlite_template):
    return "sqlite", str(sqlite_template)


async def test_an_ended_settled_run_releases_its_trajectory_objects_and_a_busy_one_keeps_them(
    common_settings,
    store,
    sessionmaker: async_sessionmaker[AsyncSession],
    client: AsyncClient,
    make_graded: Callable[..., GradedTrajectory],
) -> None:
    bus = await Bus.connect(common_settings(claim_check_bytes=1024), store=store, name="api-cleanup-test")
    await bus.ensure_streams()
    suffix = uuid.uuid4().hex[:8]
    durable = f"api-graded-cleanup-{suffix}"
    stop = asyncio.Event()
    ingest = asyncio.create_task(
        run_ingest(bus=bus, sessionmaker=sessionmaker, stop=stop, deliver_new=True,
                   graded_durable=durable, events_durable=f"api-events-cleanup-{suffix}")
    )  # fmt: skip
    runs = []
    try:
        for name in ("done", "busy"):
            created = await client.post("/v1/runs", json={"name": name})
            assert created.status_code == 201, created.text
            runs.append(created.json()["run_id"])
        done, busy = runs
        for run_id in runs:  # each graded trajectory is too big for a message: its bytes go to S3
            graded = big(make_graded(run_id, f"{run_id}-t"))
            await bus.publish(
                subjects.graded(run_id), graded, msg_id=f"{run_id}-t",
                claim_prefix=graded_claim_prefix(run_id, f"{run_id}-t"),
            )  # fmt: skip
        waiting = big(make_graded(busy, f"{busy}-w")).trajectory  # still waiting for a grader
        await bus.publish(
            subjects.rollouts(busy), waiting, claim_prefix=trajectory_claim_prefix(busy, f"{busy}-w")
        )

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        for run_id in runs:  # observed: the api ingested each
            while (await client.get(f"/v1/runs/{run_id}/trajectories")).json()["items"] == []:
                assert loop.time() < deadline and not ingest.done(), (
                    "the api never ingested the graded trajectory"
                )
                await asyncio.sleep(0.05)
        while (
            info := await bus.js.consumer_info(subjects.GRADED, durable)
        ).num_ack_pending or info.num_pending:
            assert loop.time() < deadline, "the api never acknowledged what it ingested"
            await asyncio.sleep(0.05)
        async with sessionmaker() as session:
            for run_id in runs:
                run = await session.get(Run, run_id)
                run.status, run.finished_at = "finished", utcnow() - timedelta(hours=2)
            await session.commit()
        assert len(await store.list(run_trajectories_prefix(done))) == 1
        assert len(await store.list(run_trajectories_prefix(busy))) == 2

        async def release(after_s: float) -> list[str]:
            return await release_ended_runs(
                bus=bus, store=store, sessionmaker=sessionmaker, after_s=after_s, graded_durable=durable
            )

        assert await release(after_s=3 * 3600) == []  # ended two hours ago: not yet
        assert await release(after_s=3600) == [done]
        assert await store.list(run_trajectories_prefix(done)) == []
        assert (
            len(await store.list(run_trajectories_prefix(busy))) == 2
        )  # a trajectory still waits on ROLLOUTS
        detail = await client.get(f"/v1/trajectories/{done}-t")
        assert detail.status_code == 200, detail.text  # the database holds what was ingested
        async with sessionmaker() as session:
            assert (await session.get(Run, done)).objects_released_at is not None
            assert (await session.get(Run, busy)).objects_released_at is None
        assert await release(after_s=3600) == []  # released once
    finally:
        stop.set()
        await asyncio.wait_for(ingest, timeout=10)
        for run_id in runs:
            await bus.js.purge_stream(subjects.ROLLOUTS, subject=subjects.rollouts(run_id))
        await bus.js.delete_consumer(subjects.GRADED, durable)
        await bus.js.delete_consumer(subjects.EVENTS, f"api-events-cleanup-{suffix}")
        await bus.close()
