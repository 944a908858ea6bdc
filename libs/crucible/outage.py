"""Riding out an outage: the one rule for telling Crucible's own failures apart from a message's.

A failure is the message's (`crucible.contracts.ContractError`: it will never succeed, so it is
dead-lettered at once), the infrastructure's (`Unavailable`: NATS, S3, the database or a service the work
asks is away or refusing for now, so the work is held and tried again until it answers), or a bug
(anything else: retried with backoff and dead-lettered after `max_deliver` deliveries).

Whatever raises `Unavailable` says so at the edge where it is known: the object store for its transport
and server errors, the bus for a publish or a request that nobody answers (and for a service's reply
saying it is busy or itself cut off), the api for its database.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog
from prometheus_client import Counter

log = structlog.get_logger("crucible.outage")

FIRST_RETRY_S, MAX_RETRY_S = 1.0, 30.0

RETRIES = Counter(
    "crucible_outage_retries_total",
    "Work tried again because a dependency was unavailable, by what it was",
    ["work"],
)


class Unavailable(RuntimeError):
    """A dependency cannot be reached or refuses for now; the work is not at fault and is tried again."""


async def ride_out(
    work: Callable[[], Awaitable[object]],
    *,
    stop: asyncio.Event,
    what: str,
    on_hold: Callable[[], object] | None = None,
) -> bool:
    """Run `work` until it does not raise `Unavailable`, with backoff from FIRST_RETRY_S doubling up to
    MAX_RETRY_S between tries. Returns True once it ran, False if `stop` was set while waiting.
    `on_hold` runs after each unavailable try (e.g. to keep a message's ack deadline extended). `what`
    names the work in logs and in `crucible_outage_retries_total`."""
    pause = FIRST_RETRY_S
    while True:
        try:
            await work()
            return True
        except Unavailable as exc:
            error = exc
        if on_hold is not None:
            on_hold()
        RETRIES.labels(what).inc()
        log.warning("dependency unavailable; holding the work", work=what, retry_in_s=pause, error=str(error))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=pause)
        if stop.is_set():
            return False
        pause = min(2 * pause, MAX_RETRY_S)
