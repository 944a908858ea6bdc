"""A client bus and object store on the test's own settings (its bucket, its stream prefix), for the
integration tests whose directory does not bring its own."""

from __future__ import annotations

import pytest

from crucible.bus import Bus
from crucible.objectstore import ObjectStore


@pytest.fixture
async def store(common_settings):
    store = ObjectStore.from_settings(common_settings())
    await store.ensure_bucket()
    return store


@pytest.fixture
async def bus(common_settings, store):
    bus = await Bus.connect(common_settings(), store=store, name="test-client")
    await bus.ensure_streams()
    yield bus
    await bus.close()
