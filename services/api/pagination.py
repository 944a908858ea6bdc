"""Keyset (cursor) pagination: stable under inserts, and as fast on page 1000 as on page 1.

A cursor is the sort key of the last row served, one part per key column joined by `.`: a timestamp as
microseconds since the epoch, an integer in decimal, a string (an id) as unpadded base64url of its
UTF-8. Clients treat it as opaque. Every string of a listing's cursor pattern (`TIME_ID_CURSOR`,
`NUMBER_CURSOR` or `ID_CURSOR`, which the OpenAPI document states) is a position in that listing, so
any of them is served: one the api never handed out pages from wherever it points (an empty page past
the end).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import BigInteger, ColumnElement, Select, and_, or_
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import InstrumentedAttribute

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)
MAX_ID_CHARS = 128
"""The widest id column a listing sorts by (trajectory ids); UTF-8 takes at most 4 bytes a character."""
_B64 = "[A-Za-z0-9_-]"
_ID_GROUPS = -(-4 * MAX_ID_CHARS // 3)  # base64 quads (3 bytes each) of the longest id
_TIME = "-?[0-9]{1,17}"  # microseconds; 17 digits reach year 5138
_ID = f"(?:{_B64}{{4}}){{0,{_ID_GROUPS}}}(?:{_B64}{{2,3}})?"  # unpadded: never 1 mod 4 characters
_NUMBER = "-?[0-9]{1,19}"

TIME_ID_CURSOR = f"^{_TIME}\\.{_ID}$"
"""The cursor of a listing sorted by (timestamp, id): runs, trajectories, evaluations."""
TIME_ID_CURSOR_CHARS = 1 + 17 + 1 + 4 * _ID_GROUPS + 3
NUMBER_CURSOR = f"^{_NUMBER}$"
"""The cursor of a listing sorted by one integer: steps, checkpoints."""
NUMBER_CURSOR_CHARS = 1 + 19
ID_CURSOR = f"^{_ID}$"
"""The cursor of a listing sorted by one id: a run's tasks."""
ID_CURSOR_CHARS = 4 * _ID_GROUPS + 3


class InvalidCursor(ValueError):
    """A string that is not a cursor of the listing: not of its pattern (the routes refuse those first)."""


def encode_cursor(values: Sequence[Any]) -> str:
    parts = []
    for value in values:
        if isinstance(value, datetime):
            parts.append(str((value - EPOCH) // MICROSECOND))
        elif isinstance(value, str):
            parts.append(base64.urlsafe_b64encode(value.encode()).decode().rstrip("="))
        else:
            parts.append(str(int(value)))
    return ".".join(parts)


def cursor_pattern(keys: Sequence[InstrumentedAttribute[Any]]) -> str:
    """The pattern of the cursors of a listing sorted by `keys`."""
    part = {datetime: _TIME, str: _ID, int: _NUMBER}
    return "^" + "\\.".join(part[key.type.python_type] for key in keys) + "$"


def decode_cursor(cursor: str, keys: Sequence[InstrumentedAttribute[Any]]) -> list[Any]:
    """The position a cursor of `cursor_pattern(keys)` names; total on that pattern. A timestamp or an
    integer beyond its column's range becomes the range's end (a position before or after every row)."""
    if not re.fullmatch(cursor_pattern(keys)[1:-1], cursor):
        raise InvalidCursor("invalid cursor: not one of this listing")
    values: list[Any] = []
    for key, part in zip(keys, cursor.split("."), strict=True):
        expected = key.type.python_type
        if expected is datetime:
            micros = int(part)
            try:
                values.append(EPOCH + micros * MICROSECOND)
            except OverflowError:
                values.append((datetime.max if micros > 0 else datetime.min).replace(tzinfo=UTC))
        elif expected is str:
            raw = base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
            values.append(raw.decode(errors="replace").replace("\x00", ""))  # PostgreSQL text holds no NUL
        else:
            bound = 2**63 if isinstance(key.type, BigInteger) else 2**31
            values.append(min(max(int(part), -bound), bound - 1))
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
