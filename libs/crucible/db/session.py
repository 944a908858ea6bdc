"""Async engines and sessions for PostgreSQL (asyncpg) and SQLite (aiosqlite)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

ASYNC_DRIVERS = {"postgresql": "postgresql+asyncpg", "sqlite": "sqlite+aiosqlite"}


def async_url(url: str) -> str:
    """The URL with an async driver: `postgresql://` and `sqlite://` get asyncpg and aiosqlite."""
    parsed = make_url(url)
    driver = ASYNC_DRIVERS.get(parsed.drivername)
    if driver:
        parsed = parsed.set(drivername=driver)
    elif parsed.drivername not in ASYNC_DRIVERS.values():
        raise ValueError(
            f"unsupported database URL scheme {parsed.drivername!r}: "
            "use postgresql+asyncpg:// or sqlite+aiosqlite://"
        )
    return parsed.render_as_string(hide_password=False)


def _enable_sqlite_foreign_keys(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """An async engine; a SQLite file's folder is created if missing, and foreign keys are enforced."""
    url = async_url(url)
    if url.startswith("sqlite"):
        database = make_url(url).database
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("connect_args", {"timeout": 30})
    else:
        kwargs.setdefault("pool_pre_ping", True)
    engine = create_async_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        event.listen(engine.sync_engine, "connect", _enable_sqlite_foreign_keys)
    return engine


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
