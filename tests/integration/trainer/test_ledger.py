"""The trainer's ledger over real JetStream deliveries: a graded message stays unacknowledged from its
arrival until a saved state holds what trained it, is acked untrained when its group is dropped or its
step trains nothing, and comes back when the ledger hands it back."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from test_trainer_service import graded

from crucible.bus import Bus, Delivery
from crucible.contracts import subjects
from crucible.contracts.messages import GradedTrajectory
from services.trainer.ledger import Ledger

pytestmark = pytest.mark.integration


async def _until(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@asynccontextmanager
async def graded_run(bus: Bus, groups: dict[str, list[float]], ledger: Ledger) -> AsyncIterator[Feed]:
    """A run's graded groups on the stream, consumed into `ledger` as the trainer's job does."""
    feed = Feed(bus, run_id=f"run-{uuid.uuid4().hex[:12]}")
    for group, rewards in groups.items():
        for index, reward in enumerate(rewards):
            message = graded(feed.run_id, group, index, reward, "grep")
            msg_id = f"{feed.run_id}/{message.trajectory.trajectory_id}"
            await bus.publish(subjects.graded(feed.run_id), message, msg_id=msg_id)

    async def on_graded(message: GradedTrajectory, delivery: Delivery) -> None:
        if ledger.hold(message, delivery, keep_alive_s=5.0):
            feed.arrivals.append(message.trajectory.trajectory_id)

    stop = asyncio.Event()
    consumer = asyncio.create_task(
        bus.consume(
            stream=subjects.GRADED, durable=feed.durable, filter_subject=subjects.graded(feed.run_id),
            handler=on_graded, message_type=GradedTrajectory, stop=stop, ack_wait=30, batch=8,
        )
    )  # fmt: skip
    try:
        yield feed
    finally:
        stop.set()
        await consumer
        await bus.js.delete_consumer(subjects.GRADED, feed.durable)


class Feed:
    def __init__(self, bus: Bus, *, run_id: str) -> None:
        self.bus, self.run_id = bus, run_id
        self.durable = subjects.trainer_run_durable(run_id)
        self.arrivals: list[str] = []  # trajectory ids the ledger took, in order

    async def unacked(self, expected: int) -> bool:
        """Whether the stream holds `expected` delivered messages unacknowledged."""
        info = await self.bus.js.consumer_info(subjects.GRADED, self.durable)
        return info.num_ack_pending == expected

    async def arrived(self, expected: int) -> bool:
        return len(self.arrivals) == expected


async def test_acked_means_trained_and_saved(bus: Bus) -> None:
    ledger = Ledger(trained={"g2-1"})  # trained by a saved state before a restart
    async with graded_run(bus, {"g0": [1.0, 0.0], "g1": [1.0, 0.0], "g2": [1.0, 0.0]}, ledger) as feed:
        await _until(lambda: feed.arrived(5), "five held messages")
        await _until(lambda: feed.unacked(5), "the trained one acked on sight, five held")
        assert ledger.ready(group_size=2, groups_per_step=3, timeout_s=60) == ["g0", "g1"]  # g2 is incomplete
        groups = ledger.begin_step(["g0", "g1"])
        assert sorted(g.graded[0].trajectory.trajectory_id for g in groups) == ["g0-0", "g1-0"]
        ledger.step_trained(["g0-0", "g0-1", "g1-0", "g1-1"])
        assert await feed.unacked(5)  # trained, not yet saved: nothing acked
        await ledger.saved()
        await _until(lambda: feed.unacked(1), "the saved step's four messages acked")
        assert ledger.trained >= {"g0-0", "g0-1", "g1-0", "g1-1"} and ledger.unsaved == []
        (held,) = ledger.held()  # g2-0: handed back, it comes again
        assert ledger.groups == {} and ledger.in_step == []
        await held.nak()
        await _until(lambda: _true(feed.arrivals.count("g2-0") == 2), "the handed-back message redelivered")
        assert list(ledger.groups) == ["g2"]
        assert await ledger.drop("g2") == 1  # a group that carries no signal is acked untrained
        await _until(lambda: feed.unacked(0), "every message acked")


async def test_a_step_that_trains_nothing_acks_its_messages_untrained(bus: Bus) -> None:
    ledger = Ledger()
    async with graded_run(bus, {"g": [0.0, 1.0]}, ledger) as feed:
        await _until(lambda: feed.arrived(2), "a group")
        assert ledger.ready(group_size=2, groups_per_step=1, timeout_s=60) == ["g"]
        ledger.begin_step(["g"])
        await ledger.step_untrained()
        await _until(lambda: feed.unacked(0), "the step's messages acked untrained")
        assert ledger.trained == set() and ledger.held() == []


async def _true(value: bool) -> bool:
    return value
