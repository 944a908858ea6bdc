"""Request dependencies, as `Annotated` aliases for route signatures."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Query, Request
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.bus import Bus


async def _session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.sessionmaker() as session:
        yield session


def _bus(request: Request) -> Bus | None:
    return request.app.state.bus


SessionDep = Annotated[AsyncSession, Depends(_session)]
BusDep = Annotated[Bus | None, Depends(_bus)]
LimitQuery = Annotated[int, Query(ge=1, le=500, description="Items per page.")]
CursorQuery = Annotated[
    str | None, Query(max_length=2000, description="`next_cursor` of the previous page; omit for the first.")
]
