"""What both ingestion paths share: run lookup (unknown runs are skipped, not errors) and timestamps."""

from __future__ import annotations

from datetime import UTC, datetime

import structlog
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.db.models import Run, utcnow

log = structlog.get_logger("crucible.api")


def when(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC) if ts > 0 else utcnow()


async def known_run(session: AsyncSession, run_id: str, what: str) -> Run | None:
    run = await session.get(Run, run_id)
    if run is None:
        log.warning("skipped: unknown run id", run_id=run_id, message=what)
    return run
