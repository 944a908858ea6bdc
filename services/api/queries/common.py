"""What every read shares: the not-found error and the run-exists check."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.db.models import Run


class NotFound(LookupError):
    """An id that names nothing; the message says what was looked for."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


async def require_run(session: AsyncSession, run_id: str) -> None:
    if await session.scalar(select(Run.run_id).where(Run.run_id == run_id)) is None:
        raise NotFound(f"run {run_id!r} not found")
