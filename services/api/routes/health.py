"""Liveness and readiness, for compose and Kubernetes health checks on the REST port itself."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

router = APIRouter(tags=["health"])


async def database_answers(sessionmaker: async_sessionmaker[AsyncSession]) -> None:
    """Raise unless the database answers a query (this port's readiness, and the health port's)."""
    async with sessionmaker() as session:
        await session.execute(text("SELECT 1"))


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request, response: Response) -> dict[str, Any]:
    """Ready when the database answers (and the bus is connected, where there is one)."""
    try:
        await database_answers(request.app.state.sessionmaker)
        database = True
    except Exception:  # any failure to reach the database means not ready
        database = False
    bus = request.app.state.bus
    connected = bus is None or bus.nc.is_connected
    ready = database and connected
    response.status_code = 200 if ready else 503
    return {"ready": ready, "database": database, "bus": connected}
