"""Writes that operators ask for over REST."""

from __future__ import annotations

import uuid

import structlog
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.bus import Bus
from crucible.contracts import subjects
from crucible.contracts.messages import RunCreated
from crucible.contracts.runconfig import RunConfig
from crucible.db.models import Run, utcnow
from services.api.schemas import RunOut

log = structlog.get_logger("crucible.api")


class Unavailable(RuntimeError):
    """A dependency (the bus) is down; the request may be retried."""


def new_run_id() -> str:
    """Run ids appear in subject names, so they hold only letters, digits, '-' and '_'."""
    return f"run-{uuid.uuid4().hex[:16]}"


async def create_run(*, session: AsyncSession, bus: Bus | None, name: str, config: RunConfig) -> RunOut:
    """Record the run, then announce it on `runs.<run_id>.created` (de-duplicated by run id).

    The row is committed first, so every event about the run finds it. If the announcement fails the
    run is marked failed with the reason, and the caller gets `Unavailable`.
    """
    now = utcnow()
    run = Run(
        run_id=new_run_id(),
        name=name,
        status="created",
        config=config.model_dump(mode="json"),
        created_at=now,
        updated_at=now,
    )
    session.add(run)
    await session.commit()
    if bus is None:
        log.warning("no bus; run recorded but not announced", run_id=run.run_id)
        return RunOut.model_validate(run)
    announcement = RunCreated(run_id=run.run_id, name=name, config=config, created_at=now.timestamp())
    try:
        await bus.publish(subjects.run_created(run.run_id), announcement, msg_id=run.run_id)
    except Exception as exc:  # nats raises many unrelated types when the server is away
        run.status, run.error, run.finished_at = "failed", f"could not announce the run: {exc!r}", utcnow()
        await session.commit()
        raise Unavailable(
            f"run {run.run_id} recorded but not announced, the bus is unavailable: {exc!r}"
        ) from exc
    log.info("run created", run_id=run.run_id, name=name)
    return RunOut.model_validate(run)
