"""Alembic environment for Crucible: async engines, PostgreSQL and SQLite (batch mode for SQLite).

The URL comes from the caller (crucible.db.migrate passes it, with a live connection) or from
CRUCIBLE_DATABASE_URL / the settings default when run with the `alembic` command.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import Connection, pool

from crucible.db.models import Base
from crucible.db.session import async_url, make_engine
from crucible.settings import CommonSettings

config = context.config
target_metadata = Base.metadata


def database_url() -> str:
    return async_url(config.attributes.get("url") or CommonSettings().database_url)


def configure(**kwargs: object) -> None:
    context.configure(target_metadata=target_metadata, compare_type=True, **kwargs)


def run_with(connection: Connection) -> None:
    configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


async def run_online() -> None:
    engine = make_engine(database_url(), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(run_with)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    url = database_url()
    configure(url=url, literal_binds=True, render_as_batch=url.startswith("sqlite"))
    with context.begin_transaction():
        context.run_migrations()
elif (shared := config.attributes.get("connection")) is not None:
    run_with(shared)
else:
    asyncio.run(run_online())
