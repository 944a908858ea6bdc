"""Schema migrations, run as an explicit step before services start (never at import or start-up).

`upgrade(url)` is the sync entry point for the command line (`crucible db upgrade` or `python -m
crucible.db upgrade`, see crucible.cli.db); `upgrade_async` runs inside an event loop (tests, the local
launcher). Alembic is configured in code: the scripts live in the repository's migrations/ folder, or
wherever CRUCIBLE_MIGRATIONS_DIR points (container images copy it there).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from crucible.db.session import async_url, make_engine

MIGRATIONS_DIR_ENV = "CRUCIBLE_MIGRATIONS_DIR"


class SchemaError(RuntimeError):
    """The database schema is not at the revision this code expects."""


def migrations_dir() -> Path:
    configured = os.environ.get(MIGRATIONS_DIR_ENV)
    candidates = [Path(configured)] if configured else [Path(__file__).resolve().parents[3] / "migrations"]
    candidates.append(Path.cwd() / "migrations")
    for path in candidates:
        if (path / "env.py").is_file():
            return path
    tried = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(f"Alembic migrations not found (tried {tried}); set {MIGRATIONS_DIR_ENV}")


def alembic_config(url: str | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    if url is not None:
        config.attributes["url"] = async_url(url)
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise SchemaError("no migration scripts found")
    return head


def _run_command(connection: Connection, config: Config, name: str, revision: str) -> None:
    config.attributes["connection"] = connection
    getattr(command, name)(config, revision)


async def _run(url: str, name: str, revision: str) -> None:
    config = alembic_config(url)
    engine = make_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_run_command, config, name, revision)
    finally:
        await engine.dispose()


async def upgrade_async(url: str, revision: str = "head") -> None:
    await _run(url, "upgrade", revision)


async def downgrade_async(url: str, revision: str) -> None:
    await _run(url, "downgrade", revision)


def upgrade(url: str, revision: str = "head") -> None:
    asyncio.run(upgrade_async(url, revision))


def downgrade(url: str, revision: str) -> None:
    asyncio.run(downgrade_async(url, revision))


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(lambda sync: MigrationContext.configure(sync).get_current_revision())


async def check_schema(engine: AsyncEngine) -> None:
    """Fail with a clear message unless the database is migrated to the newest revision."""
    current, head = await current_revision(engine), head_revision()
    if current != head:
        where = engine.url.render_as_string(hide_password=True)
        raise SchemaError(
            f"database {where} is at schema revision {current or 'none'}, this code needs {head}: "
            "run `python -m crucible.db upgrade` (or `crucible db upgrade`) first"
        )
