"""The checkpoints service running in-process on the test's servers, and a client bus + store."""

from __future__ import annotations

import asyncio

import pytest

from crucible.bus import Bus
from crucible.objectstore import ObjectStore
from crucible.runtime import Runtime, run
from services.checkpoints.app import setup
from services.checkpoints.settings import Settings


@pytest.fixture
def checkpoints_settings(common_settings, request):
    """Service settings; a test overrides fields with indirect parametrization."""
    return common_settings(Settings, **getattr(request, "param", {}))


@pytest.fixture
async def service(checkpoints_settings):
    started: asyncio.Future[Runtime] = asyncio.get_running_loop().create_future()

    async def setup_and_report(rt: Runtime) -> None:
        await setup(rt)
        started.set_result(rt)

    task = asyncio.create_task(run("checkpoints", checkpoints_settings, setup_and_report))
    done, _ = await asyncio.wait([started, task], timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
    rt = started.result()
    yield rt
    rt.stopping.set()
    await asyncio.wait_for(task, timeout=30)


@pytest.fixture
async def store(checkpoints_settings):
    store = ObjectStore.from_settings(checkpoints_settings)
    await store.ensure_bucket()
    return store


@pytest.fixture
async def bus(checkpoints_settings, store, service):
    bus = await Bus.connect(checkpoints_settings, store=store, name="test-client")
    yield bus
    await bus.close()
