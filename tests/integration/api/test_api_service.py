"""`python -m services.api` as operators run it from its image, which has no torch: real NATS, S3 and
Redis, a migrated SQLite file."""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from api_process import key_headers, start_api, wait_ready

from crucible.bus import Bus
from crucible.contracts import subjects
from crucible.contracts.events import Event, RunStatus
from crucible.db.migrate import upgrade_async
from crucible.localstack.processes import free_ports
from services.api.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_service_serves_rest_ingests_and_stops_cleanly(
    common_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    database = f"sqlite+aiosqlite:///{tmp_path / 'crucible.db'}"
    await upgrade_async(database)
    (port,) = free_ports(count=1)
    suffix = uuid.uuid4().hex[:8]
    durables = {"graded_durable": f"api-graded-{suffix}", "events_durable": f"api-events-{suffix}"}
    settings = common_settings(Settings, database_url=database, api_port=port, **durables)
    log = tmp_path / "api.log"
    proc = start_api(settings, log)
    bus = await Bus.connect(settings, name="api-service-test")
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc, log)
        headers = key_headers(database)
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=10) as client:
            created = await client.post("/v1/runs", json={"name": "svc"})
            assert created.status_code == 201, created.text
            run_id = created.json()["run_id"]
            assert (await client.get(f"/v1/runs/{run_id}/bogus")).status_code == 404
            event = Event.now(run_id, RunStatus(status="running"), source="test")
            await bus.publish(event.subject, event)
            for _ in range(100):
                if (await client.get(f"/v1/runs/{run_id}")).json()["status"] == "running":
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"the event was not ingested:\n{log.read_text()}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await bus.js.delete_consumer(subjects.GRADED, durables["graded_durable"])
        await bus.js.delete_consumer(subjects.EVENTS, durables["events_durable"])
        await bus.close()


def test_service_refuses_an_unmigrated_database(
    common_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    (port,) = free_ports(count=1)
    settings = common_settings(Settings, database_url=f"sqlite:///{tmp_path / 'empty.db'}", api_port=port)
    log = tmp_path / "api.log"
    proc = start_api(settings, log)
    assert proc.wait(timeout=60) == 1
    assert "schema revision none" in log.read_text() and "crucible.db upgrade" in log.read_text()
