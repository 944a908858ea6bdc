"""Keyset (cursor) pagination: stable under inserts, and as fast on page 1000 as on page 1.

A cursor is the sort key of the last row served, as base64url JSON; clients treat it as opaque. One
that does not decode to values of the listing's key types (timestamps with their zone, integers within
64 bits) is refused with a 400 before it reaches the database.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, or_
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import InstrumentedAttribute


class InvalidCursor(ValueError):
    """A cursor this API did not hand out (or one for a different listing)."""


def encode_cursor(values: Sequence[Any]) -> str:
    plain = [v.isoformat() if isinstance(v, datetime) else v for v in values]
    return base64.urlsafe_b64encode(json.dumps(plain).encode()).decode().rstrip("=")


def decode_cursor(cursor: str, keys: Sequence[InstrumentedAttribute[Any]]) -> list[Any]:
    try:
        raw = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError) as exc:
        raise InvalidCursor("invalid cursor: not one this API returned") from exc
    if not isinstance(raw, list) or len(raw) != len(keys):
        raise InvalidCursor("invalid cursor: not one this API returned for this listing")
    values = []
    for key, value in zip(keys, raw, strict=True):
        expected = key.type.python_type
        try:
            if expected is datetime:
                value = datetime.fromisoformat(value)
                if value.tzinfo is None:
                    raise ValueError("a naive timestamp")
                value = value.astimezone(UTC)
            elif type(value) is not expected:
                raise TypeError(value)
            elif expected is int and not -(2**63) <= value < 2**63:
                raise ValueError("an integer beyond 64 bits")
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidCursor("invalid cursor: not one this API returned for this listing") from exc
        values.append(value)
    return values


def _after(
    keys: Sequence[InstrumentedAttribute[Any]], values: list[Any], descending: bool
) -> ColumnElement[bool]:
    """Rows strictly after `values` in (keys...) order: a lexicographic comparison spelled out."""
    first, rest = keys[0], keys[1:]
    beyond = first < values[0] if descending else first > values[0]
    if not rest:
        return beyond
    return or_(beyond, and_(first == values[0], _after(rest, values[1:], descending)))


async def paginate(
    *,
    session: AsyncSession,
    stmt: Select[Any],
    keys: Sequence[InstrumentedAttribute[Any]],
    cursor: str | None,
    limit: int,
    descending: bool = False,
) -> tuple[list[Any], str | None]:
    """One page of `stmt`'s rows ordered by `keys` (unique together; attributes of the statement's first
    entity), and the cursor of the next page."""
    if cursor:
        stmt = stmt.where(_after(keys, decode_cursor(cursor, keys), descending))
    stmt = stmt.order_by(*(k.desc() if descending else k.asc() for k in keys)).limit(limit + 1)
    rows = list((await session.execute(stmt)).all())
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    last = rows[-1][0]
    return rows, encode_cursor([getattr(last, key.key) for key in keys])
