from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from crucible.db.scratch import scratch_database


@pytest.fixture(params=["sqlite", "postgresql"])
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """An empty database: a fresh SQLite file, or a scratch PostgreSQL database dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'crucible.db'}"
        return
    async with scratch_database() as url:
        yield url
