"""The sandbox service running in-process on the test's servers, and a client bus + store."""

from __future__ import annotations

import shutil
import uuid

import pytest

from crucible.bus import Bus
from crucible.objectstore import ObjectStore
from crucible.runtime import running
from services.sandbox.app import setup
from services.sandbox.settings import Settings


@pytest.fixture
def sandbox_settings(common_settings, sandbox_root, request):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    overrides = {"workspace_root": sandbox_root, "replica": f"sb-{uuid.uuid4().hex[:8]}"}
    return common_settings(Settings, **{**overrides, **getattr(request, "param", {})})


@pytest.fixture
async def service(sandbox_settings):
    async with running("sandbox", sandbox_settings, setup) as rt:
        yield rt


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
