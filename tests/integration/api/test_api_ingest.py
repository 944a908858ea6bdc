"""Ingestion over a real NATS JetStream server: the api's consumers fill the tables REST reads."""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from api_process import key_headers
from httpx import ASGITransport, AsyncClient
from prometheus_client import REGISTRY
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from crucible.bus import Bus
from crucible.contracts import subjects
from crucible.contracts.events import CheckpointPublished, Event, EventPayload, RunStatus, StepReport
from crucible.contracts.messages import DeadLetter, GradedTrajectory, RunCreated
from services.api.app import create_app
from services.api.ingest import run_ingest
from services.api.settings import Settings

pytestmark = pytest.mark.integration


@pytest.fixture(params=["sqlite"])
def migrated_template(request: pytest.FixtureRequest, sqlite_template: Path) -> tuple[str, str]:
    """The bus path is the same for both databases; SQLite keeps this test quick."""
    return "sqlite", str(sqlite_template)


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    bus = await Bus.connect(Settings(nats_url=nats_url), name="api-test")
    await bus.ensure_streams()
    yield bus
    await bus.close()


@pytest.fixture
async def ingesting(bus: Bus, sessionmaker: async_sessionmaker[AsyncSession]) -> AsyncIterator[None]:
    """run_ingest on private durables that start at the stream's end, so other tests' messages stay out."""
    stop = asyncio.Event()
    suffix = uuid.uuid4().hex[:8]
    durables = {"graded_durable": f"api-graded-test-{suffix}", "events_durable": f"api-events-test-{suffix}"}
    task = asyncio.create_task(
        run_ingest(bus=bus, sessionmaker=sessionmaker, stop=stop, max_deliver=2, deliver_new=True, **durables)
    )
    for stream, durable in (
        (subjects.GRADED, durables["graded_durable"]),
        (subjects.EVENTS, durables["events_durable"]),
    ):
        await eventually(lambda s=stream, d=durable: bus.js.consumer_info(s, d), timeout=10)
    yield
    if task.done():
        task.result()
    stop.set()
    await asyncio.wait_for(task, timeout=10)
    for stream, durable in (
        (subjects.GRADED, durables["graded_durable"]),
        (subjects.EVENTS, durables["events_durable"]),
    ):
        await bus.js.delete_consumer(stream, durable)


async def eventually(probe: Callable[[], Any], *, timeout: float = 15.0) -> Any:
    """Retry `probe` (sync or async) until it returns something truthy without raising."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            result = probe()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.1)


async def collect(bus: Bus, subject: str, type_: type) -> list:
    received: list = []

    async def on_message(message: Any) -> None:
        received.append(message)

    await bus.watch(subject, type_, on_message)
    return received


async def test_history_arrives_over_the_bus_and_bad_messages_are_dead_lettered(
    bus: Bus,
    ingesting: None,
    database_url: str,
    sessionmaker: async_sessionmaker[AsyncSession],
    make_graded: Callable[..., GradedTrajectory],
) -> None:
    announced = await collect(bus, subjects.RUNS_CREATED_ALL, RunCreated)
    dead = await collect(bus, subjects.dead_letter(subjects.EVENTS), DeadLetter)
    dead_graded = await collect(bus, subjects.dead_letter(subjects.GRADED), DeadLetter)
    created_count = {"method": "POST", "route": "/v1/runs", "status": "201"}
    metrics_before = (metric("crucible_api_ingested_total", stream="GRADED"),
                      metric("crucible_api_http_requests_total", **created_count))  # fmt: skip
    app = create_app(settings=Settings(), sessionmaker=sessionmaker, bus=bus)
    headers = key_headers(database_url, "write")
    async with AsyncClient(
        transport=ASGITransport(app=app), base_url="http://api", headers=headers
    ) as client:
        created = await client.post("/v1/runs", json={"name": "bus", "config": {"seed": 5}})
        assert created.status_code == 201, created.text
        run_id = created.json()["run_id"]
        run = await eventually(lambda: next((m for m in announced if m.run_id == run_id), None))
        assert run.config.seed == 5 and run.name == "bus"

        async def emit(data: EventPayload) -> None:
            event = Event(run_id=run_id, ts=1.0, data=data)
            await bus.publish(event.subject, event)

        await emit(RunStatus(status="running"))
        a, b = f"{run_id}-a", f"{run_id}-b"  # ids are unique on the bus: JetStream de-duplicates by them
        first = make_graded(run_id, a, reward=1.0)
        for message, msg_id in ((first, a), (first, a), (first, None), (make_graded(run_id, b), b)):
            await bus.publish(subjects.graded(run_id), message, msg_id=msg_id)
        await emit(StepReport(step=1, version=0, metrics={"loss": 0.25}, trajectory_ids=[a, b]))
        await emit(
            CheckpointPublished(
                version=1, step=1, manifest_uri="s3://crucible/m.json", num_tensors=3, size_bytes=9
            )
        )

        async def trajectories() -> list[dict]:
            items = (await client.get(f"/v1/runs/{run_id}/trajectories")).json()["items"]
            return (
                items
                if {i["trajectory_id"] for i in items} == {a, b} and all(i["trained_count"] for i in items)
                else []
            )

        items = await eventually(trajectories)
        assert all(i["graded_count"] == 1 and i["trained_count"] == 1 for i in items), items
        checkpoints = await eventually(lambda: _items(client, f"/v1/runs/{run_id}/checkpoints"))
        assert checkpoints[0]["manifest_uri"] == "s3://crucible/m.json"

        garbage = b"\xc1 not msgpack " + uuid.uuid4().bytes
        await bus.js.publish(subjects.events(run_id, "step"), garbage)
        invalid = {"type": "event.v2", "run_id": run_id, "ts": 1.0, "data": {"kind": "step", "version": 0}}
        await bus.js.publish(subjects.events(run_id, "step"), msgspec.msgpack.encode(invalid))
        await emit(RunStatus(status="finished"))

        def ours() -> list[str] | None:  # a letter may arrive twice: the bus delivers at least once
            reasons = [d.reason for d in dead if d.payload == garbage or run_id.encode() in d.payload]
            malformed = any("not a valid Event: MessagePack data is malformed" in r for r in reasons)
            return (
                reasons
                if malformed and any("missing required field `step` - at `$.data`" in r for r in reasons)
                else None
            )

        await eventually(ours)
        finished = await eventually(lambda: _finished(client, run_id))
        assert finished["finished_at"] is not None

        # Forged graded trajectories whose arrays or numbers cannot be served are refused at ingest, so
        # no detail page fails on them later.
        short, nan = f"{run_id}-short", f"{run_id}-nan"
        forged = make_graded(run_id, short)
        forged.trajectory.loss_mask = forged.trajectory.loss_mask[:-1]
        await bus.publish(subjects.graded(run_id), forged)
        forged = make_graded(run_id, nan)
        forged.reward.total = float("nan")
        await bus.publish(subjects.graded(run_id), forged)

        def refused() -> list[str] | None:
            reasons = [
                d.reason for d in dead_graded if short.encode() in d.payload or nan.encode() in d.payload
            ]
            lengths = any(f"{short}: per-token arrays differ in length" in r for r in reasons)
            return (
                reasons
                if lengths and any(f"{nan}: a reward or timing that is not finite" in r for r in reasons)
                else None
            )

        await eventually(refused)
        for trajectory_id in (short, nan):
            assert (await client.get(f"/v1/trajectories/{trajectory_id}")).status_code == 404
    # Every delivery stored is counted (the duplicate without a message id too), and the REST request.
    graded_stored = metric("crucible_api_ingested_total", stream="GRADED") - metrics_before[0]
    assert graded_stored >= 3
    assert metric("crucible_api_http_requests_total", **created_count) - metrics_before[1] == 1


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _items(client: AsyncClient, path: str) -> list[dict]:
    return (await client.get(path)).json()["items"]


async def _finished(client: AsyncClient, run_id: str) -> dict | None:
    run = (await client.get(f"/v1/runs/{run_id}")).json()
    return run if run["status"] == "finished" else None


async def test_create_run_is_503_when_the_bus_is_down(
    sessionmaker: async_sessionmaker[AsyncSession], database_url: str, nats_url: str
) -> None:
    bus = await Bus.connect(Settings(nats_url=nats_url), name="api-test")
    await bus.close()
    app = create_app(settings=Settings(), sessionmaker=sessionmaker, bus=bus)
    headers = key_headers(database_url, "write")
    async with AsyncClient(
        transport=ASGITransport(app=app), base_url="http://api", headers=headers
    ) as client:
        response = await client.post("/v1/runs", json={"name": "offline"})
        assert response.status_code == 503
        assert "recorded but not announced, the bus is unavailable" in response.json()["detail"]
        (run,) = (await client.get("/v1/runs")).json()["items"]
        assert run["status"] == "failed" and "could not announce" in run["error"]


async def test_an_event_is_held_through_a_database_outage_and_stored_once(bus: Bus, tmp_path: Path) -> None:
    """The database cannot be opened (a file stands where its folder should be): the event is delivered
    and held, neither acknowledged nor dead-lettered, and stored once the database is there."""
    from crucible.db import make_engine, make_sessionmaker
    from crucible.db.migrate import upgrade_async
    from crucible.db.models import Run

    url = f"sqlite+aiosqlite:///{tmp_path / 'later' / 'crucible.db'}"
    engine = make_engine(url)  # makes the folder...
    (tmp_path / "later").rmdir()
    (tmp_path / "later").write_text("not a folder")  # ...which an outage takes away
    stop = asyncio.Event()
    suffix = uuid.uuid4().hex[:8]
    durables = {
        "graded_durable": f"api-graded-outage-{suffix}",
        "events_durable": f"api-events-outage-{suffix}",
    }
    task = asyncio.create_task(
        run_ingest(bus=bus, sessionmaker=make_sessionmaker(engine), stop=stop, deliver_new=True, **durables)
    )
    durable = durables["events_durable"]
    try:
        await eventually(lambda: bus.js.consumer_info(subjects.EVENTS, durable), timeout=10)
        run_id = f"run-outage-{suffix}"
        event = Event(run_id=run_id, ts=1.0, data=RunStatus(status="running"))
        await bus.publish(event.subject, event)

        async def held():
            info = await bus.js.consumer_info(subjects.EVENTS, durable)
            return info if info.num_ack_pending == 1 and info.delivered.stream_seq > 0 else None

        await eventually(held)
        (tmp_path / "later").unlink()  # the database comes back
        (tmp_path / "later").mkdir()
        await upgrade_async(url)
        async with make_sessionmaker(engine)() as session:
            session.add(Run(run_id=run_id, name="outage", status="created", config={}))
            await session.commit()

        async def stored():
            async with make_sessionmaker(engine)() as session:
                return (await session.get(Run, run_id)).status == "running"

        async def acked():
            info = await bus.js.consumer_info(subjects.EVENTS, durable)
            return info if info.num_ack_pending == 0 else None

        await eventually(stored, timeout=30)
        info = await eventually(acked)
        assert info.num_redelivered == 0  # held the whole time, never handed back or dead-lettered
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=15)
        for stream, name in ((subjects.GRADED, durables["graded_durable"]), (subjects.EVENTS, durable)):
            await bus.js.delete_consumer(stream, name)
        await engine.dispose()
