"""Statements that differ by dialect, behind one call."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncSession


async def insert_or_ignore(session: AsyncSession, model: type[Any], **values: Any) -> bool:
    """INSERT ... ON CONFLICT DO NOTHING on PostgreSQL and SQLite. True if a row was inserted.

    Concurrent inserts of the same key wait for each other, so exactly one of them reports True: the
    basis of idempotent, at-least-once ingestion.
    """
    dialect = session.get_bind().dialect.name
    insert = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}.get(dialect)
    if insert is None:
        raise NotImplementedError(f"insert_or_ignore does not support {dialect}")
    result = await session.execute(insert(model).values(**values).on_conflict_do_nothing())
    return cast(CursorResult[Any], result).rowcount == 1  # a DML statement's result is a CursorResult
