"""Migrated databases, a per-test object store, and the catalog service running in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from crucible.bus import Bus
from crucible.db import make_engine, make_sessionmaker
from crucible.db.migrate import upgrade_async
from crucible.db.scratch import scratch_database
from crucible.objectstore import ObjectStore
from crucible.runtime import running
from services.catalog.app import setup
from services.catalog.settings import Settings


@pytest.fixture(params=["sqlite", "postgresql"])
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"
        await upgrade_async(url)
        yield url
        return
    try:
        scratch = scratch_database()
        url = await scratch.__aenter__()
    except OSError as exc:
        pytest.skip(f"PostgreSQL is unreachable: {exc}")
    try:
        await upgrade_async(url)
        yield url
    finally:
        await scratch.__aexit__(None, None, None)


@pytest.fixture
async def sessionmaker(database_url):
    engine = make_engine(database_url)
    yield make_sessionmaker(engine)
    await engine.dispose()


@pytest.fixture
def catalog_settings(common_settings, request):
    """Service settings: one task per level, levels 1 and 2; a test overrides with indirect
    parametrization."""
    overrides = {"tasks_per_difficulty": 1, "difficulties": [1, 2], "taskset_seed": 4}
    return common_settings(Settings, **{**overrides, **getattr(request, "param", {})})


@pytest.fixture
async def store(catalog_settings):
    store = ObjectStore.from_settings(catalog_settings)
    await store.ensure_bucket()
    return store


@pytest.fixture
async def service(catalog_settings):
    await upgrade_async(catalog_settings.database_url)
    async with running("catalog", catalog_settings, setup, timeout_s=120) as rt:
        yield rt


@pytest.fixture
async def bus(catalog_settings, store, service):
    bus = await Bus.connect(catalog_settings, store=store, name="test-client")
    yield bus
    await bus.close()
