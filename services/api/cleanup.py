"""Releasing a run's trajectory objects once nobody can need them.

A trajectory or graded trajectory too big for a message travels as a claim check: its bytes sit under
`runs/<run>/trajectories/` in the object store until deleted here. They are deleted when the run has
ended at least `release_objects_after_s` ago, nothing of it waits on ROLLOUTS (every trajectory was
graded), and this api's GRADED consumer has settled every graded message of the run (the database
holds each one whole, so its detail page never needs the object). The run's `objects_released_at`
records it. A message of the run replayed from the dead-letter stream after that no longer finds its
payload and is parked again, with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta

import nats.errors
import nats.js.errors
import structlog
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from crucible.bus import Bus
from crucible.contracts import subjects
from crucible.contracts.events import TERMINAL_STATUSES
from crucible.contracts.keys import run_trajectories_prefix
from crucible.db.models import Run, utcnow
from crucible.objectstore import ObjectStore
from crucible.outage import Unavailable

log = structlog.get_logger("crucible.api.cleanup")


async def settled(bus: Bus, run_id: str, *, graded_durable: str) -> bool:
    """Nothing of the run waits to be graded, and the api has settled every graded message of it."""
    subject = subjects.rollouts(run_id)
    rollouts = await bus.js.stream_info(subjects.ROLLOUTS, subjects_filter=subject)
    if (rollouts.state.subjects or {}).get(subject, 0):
        return False
    try:
        last = await bus.js.get_last_msg(subjects.GRADED, subjects.graded(run_id))
    except nats.js.errors.NotFoundError:
        return True  # nothing was graded (or the stream's limits retired it all)
    consumer = await bus.js.consumer_info(subjects.GRADED, graded_durable)
    # Optional in nats-py's types, always sent by the server for a consumer and a stored message
    assert consumer.ack_floor is not None and last.seq is not None
    return consumer.ack_floor.stream_seq >= last.seq


async def release_ended_runs(
    *,
    bus: Bus,
    store: ObjectStore,
    sessionmaker: async_sessionmaker[AsyncSession],
    after_s: float,
    graded_durable: str,
) -> list[str]:
    """Delete the trajectory objects of every run that ended over `after_s` ago and is settled; returns
    the runs released."""
    released = []
    async with sessionmaker() as session:
        ended = await session.scalars(
            select(Run).where(
                Run.status.in_(TERMINAL_STATUSES),
                Run.finished_at <= utcnow() - timedelta(seconds=after_s),
                Run.objects_released_at.is_(None),
            )
        )
        for run in ended.all():
            if not await settled(bus, run.run_id, graded_durable=graded_durable):
                continue
            keys = await store.list(run_trajectories_prefix(run.run_id))
            for key in keys:
                await store.delete(key)
            run.objects_released_at = utcnow()
            await session.commit()
            log.info("released a run's trajectory objects", run_id=run.run_id, objects=len(keys))
            released.append(run.run_id)
    return released


async def run_cleanup(
    *,
    bus: Bus,
    store: ObjectStore,
    sessionmaker: async_sessionmaker[AsyncSession],
    stop: asyncio.Event,
    after_s: float,
    every_s: float,
    graded_durable: str,
) -> None:
    """Release ended runs' objects every `every_s` until `stop`; an outage or a bug waits for the next
    round."""
    while not stop.is_set():
        try:
            await release_ended_runs(
                bus=bus,
                store=store,
                sessionmaker=sessionmaker,
                after_s=after_s,
                graded_durable=graded_durable,
            )
        except (Unavailable, nats.errors.Error, TimeoutError, OSError) as exc:
            log.warning("could not release trajectory objects this round", error=repr(exc))
        except Exception:  # the api must outlive a failed round
            log.exception("releasing trajectory objects failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every_s)
