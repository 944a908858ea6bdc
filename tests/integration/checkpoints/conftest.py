"""The checkpoints service running in-process on the test's servers, and a client bus + store."""

from __future__ import annotations

import pytest

from crucible.bus import Bus
from crucible.objectstore import ObjectStore
from crucible.runtime import running
from services.checkpoints.app import setup
from services.checkpoints.settings import Settings


@pytest.fixture
def checkpoints_settings(common_settings, request):
    """Service settings; a test overrides fields with indirect parametrization."""
    return common_settings(Settings, **getattr(request, "param", {}))


@pytest.fixture
async def service(checkpoints_settings):
    async with running("checkpoints", checkpoints_settings, setup) as rt:
        yield rt


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
