"""Request dependencies, as `Annotated` aliases for route signatures."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Path, Query, Request
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.bus import Bus
from crucible.contracts.inputs import PRINTABLE
from services.api.commands import ConfigCheck
from services.api.pagination import (
    ID_CURSOR,
    ID_CURSOR_CHARS,
    NUMBER_CURSOR,
    NUMBER_CURSOR_CHARS,
    TIME_ID_CURSOR,
    TIME_ID_CURSOR_CHARS,
)


async def _session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.sessionmaker() as session:
        yield session


def _bus(request: Request) -> Bus | None:
    return request.app.state.bus


def _config_check(request: Request) -> ConfigCheck:
    return request.app.state.config_check


SessionDep = Annotated[AsyncSession, Depends(_session)]
BusDep = Annotated[Bus | None, Depends(_bus)]
ConfigCheckDep = Annotated[ConfigCheck, Depends(_config_check)]
LimitQuery = Annotated[int, Query(ge=1, le=500, description="Items per page.")]
_CURSOR = (
    "`next_cursor` of the previous page; omit for the first. Any string of the pattern is a position in the"
    " listing: one the api did not hand out is served from where it points."
)
TimeCursorQuery = Annotated[
    str | None, Query(max_length=TIME_ID_CURSOR_CHARS, pattern=TIME_ID_CURSOR, description=_CURSOR)
]
"""The cursor of a listing by (timestamp, id): runs, trajectories, evaluations."""
NumberCursorQuery = Annotated[
    str | None, Query(max_length=NUMBER_CURSOR_CHARS, pattern=NUMBER_CURSOR, description=_CURSOR)
]
"""The cursor of a listing by a number: steps, checkpoints."""
IdCursorQuery = Annotated[
    str | None, Query(max_length=ID_CURSOR_CHARS, pattern=ID_CURSOR, description=_CURSOR)
]
"""The cursor of a listing by an id: a run's tasks."""
IdPath = Annotated[str, Path(min_length=1, max_length=200, pattern=PRINTABLE)]
"""A run, trajectory or evaluation id in a path."""
TextQuery = Annotated[str | None, Query(max_length=1000, pattern=PRINTABLE)]
