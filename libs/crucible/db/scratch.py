"""Throwaway PostgreSQL databases, for tests and demos that must not touch a real one.

`scratch_database()` creates `crucible_test_<random>` on the server named by CRUCIBLE_TEST_POSTGRES_URL
(default: the local server, user postgres), yields its URL and drops it afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy import text
from sqlalchemy.engine import make_url

from crucible.db.session import make_engine

SERVER_ENV = "CRUCIBLE_TEST_POSTGRES_URL"
DEFAULT_SERVER = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"


@asynccontextmanager
async def scratch_database(
    *, server_url: str | None = None, prefix: str = "crucible_test", template: str | None = None
) -> AsyncIterator[str]:
    """A new, empty database (or a copy of `template`, a database no one is connected to), dropped on exit."""
    server = make_url(server_url or os.environ.get(SERVER_ENV, DEFAULT_SERVER))
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = make_engine(server.render_as_string(hide_password=False), isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as conn:
            copy = f' TEMPLATE "{template}"' if template else ""
            await conn.execute(text(f'CREATE DATABASE "{name}"{copy}'))
        try:
            yield server.set(database=name).render_as_string(hide_password=False)
        finally:
            async with admin.connect() as conn:
                await conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        await admin.dispose()
