"""A bus on the test's own bucket, with a small claim-check threshold so claim checks are exercised."""

from __future__ import annotations

import pytest

from crucible.bus import Bus
from crucible.objectstore import ObjectStore


@pytest.fixture
async def bus(common_settings):
    settings = common_settings(claim_check_bytes=4096)
    store = ObjectStore.from_settings(settings)
    await store.ensure_bucket()
    bus = await Bus.connect(settings, store=store, name="test")
    await bus.ensure_streams()
    yield bus
    await bus.close()
