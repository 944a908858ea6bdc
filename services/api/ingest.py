"""The api's stream consumers: GRADED and EVENTS into the run history tables.

Durable pull consumers, so a restarted or second replica continues where the last ack left off. A
message that cannot be decoded, or whose content is invalid, ends on the dead-letter stream with the
reason (the bus does that); one about an unknown run is logged and acknowledged. While the database is
unreachable a message is held (its ack deadline extended) and retried, never dead-lettered: the
database errors become `crucible.outage.Unavailable`, which the bus rides out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from crucible.bus import Bus, Delivery, Handler
from crucible.contracts import subjects
from crucible.contracts.events import Event
from crucible.contracts.messages import GradedTrajectory, Message
from crucible.outage import Unavailable
from services.api.metrics import INGESTED
from services.api.records import apply_event, record_graded
from services.api.trackers import Trackers

log = structlog.get_logger("crucible.api")
UNREACHABLE = (OperationalError, InterfaceError, OSError)


async def _store(work: Callable[[], Awaitable[object]]) -> None:
    """Run a database write; the database being away is an outage (the bus holds the message)."""
    try:
        await work()
    except UNREACHABLE as exc:
        raise Unavailable(f"database unavailable: {type(exc).__name__}: {exc}") from exc


async def run_ingest(
    *,
    bus: Bus,
    sessionmaker: async_sessionmaker[AsyncSession],
    stop: asyncio.Event,
    batch: int = 1,
    max_deliver: int = 5,
    graded_durable: str = subjects.API_GRADED_DURABLE,
    events_durable: str = subjects.API_EVENTS_DURABLE,
    deliver_new: bool = False,
    trackers: Trackers | None = None,
) -> None:
    """Consume GRADED and EVENTS until `stop` is set; what is stored also goes to `trackers`."""

    async def on_graded(graded: GradedTrajectory, delivery: Delivery) -> None:
        async def work() -> None:
            async with sessionmaker() as session:
                await record_graded(session=session, graded=graded)
                if trackers is not None:
                    await trackers.observe_graded(session, graded)

        await _store(work)
        INGESTED.labels(subjects.GRADED).inc()

    async def on_event(event: Event, delivery: Delivery) -> None:
        async def work() -> None:
            async with sessionmaker() as session:
                await apply_event(session=session, event=event)
                if trackers is not None:
                    await trackers.observe_event(session, event)

        await _store(work)
        INGESTED.labels(subjects.EVENTS).inc()

    async def consume(stream: str, durable: str, handler: Handler, message_type: type[Message]) -> None:
        """Keep the consumer running: a bus failure is logged and the consumer re-attached."""
        while not stop.is_set():
            try:
                await bus.consume(
                    stream=stream,
                    durable=durable,
                    filter_subject=subjects.STREAMS[stream].all_subjects,
                    handler=handler,
                    message_type=message_type,
                    stop=stop,
                    batch=batch,
                    max_deliver=max_deliver,
                    deliver_new=deliver_new,
                )
            except Exception as exc:  # nats raises many unrelated types; the api must stay up
                log.error("consumer failed; re-attaching", stream=stream, durable=durable, error=repr(exc))
                await asyncio.sleep(1.0)

    try:
        await asyncio.gather(
            consume(subjects.GRADED, graded_durable, on_graded, GradedTrajectory),
            consume(subjects.EVENTS, events_durable, on_event, Event),
        )
    finally:
        if trackers is not None:
            trackers.close()
