"""The sandbox service running in-process on the test's servers, and a client bus + store."""

from __future__ import annotations

import asyncio
import shutil
import uuid

import pytest

from crucible.bus import Bus
from crucible.objectstore import ObjectStore
from crucible.runtime import Runtime, run
from services.sandbox.app import setup
from services.sandbox.settings import Settings


@pytest.fixture
def sandbox_settings(common_settings, tmp_path, request):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    overrides = {"workspace_root": tmp_path / "sandboxes", "replica": f"sb-{uuid.uuid4().hex[:8]}"}
    return common_settings(Settings, **{**overrides, **getattr(request, "param", {})})


@pytest.fixture
async def service(sandbox_settings):
    started: asyncio.Future[Runtime] = asyncio.get_running_loop().create_future()

    async def setup_and_report(rt: Runtime) -> None:
        await setup(rt)
        started.set_result(rt)

    task = asyncio.create_task(run("sandbox", sandbox_settings, setup_and_report))
    done, _ = await asyncio.wait([started, task], timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
    rt = started.result()
    yield rt
    rt.stopping.set()
    await asyncio.wait_for(task, timeout=30)


@pytest.fixture
async def store(sandbox_settings):
    store = ObjectStore.from_settings(sandbox_settings)
    await store.ensure_bucket()
    return store


@pytest.fixture
async def bus(sandbox_settings, store, service):
    bus = await Bus.connect(sandbox_settings, store=store, name="test-client")
    yield bus
    await bus.close()
