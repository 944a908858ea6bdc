"""The trainer's ledger over real JetStream deliveries: a graded message stays unacknowledged from its
arrival until a saved state holds what trained it, is acked untrained when its group is dropped or its
step trains nothing, and comes back when the ledger hands it back."""

from __future__ import annotations

import asyncio
import time
import uuid

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


async def test_acked_means_trained_and_saved(bus: Bus) -> None:
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    durable = subjects.trainer_run_durable(run_id)
    for group in ("g0", "g1", "g2"):
        for index, reward in enumerate((1.0, 0.0)):
            message = graded(run_id, group, index, reward, "grep")
            await bus.publish(
                subjects.graded(run_id), message, msg_id=f"{run_id}/{message.trajectory.trajectory_id}"
            )
    ledger = Ledger(trained={"g2-1"})  # trained by a saved state before a restart
    arrivals: list[str] = []

    async def on_graded(message: GradedTrajectory, delivery: Delivery) -> None:
        if ledger.hold(message, delivery, keep_alive_s=5.0):
            arrivals.append(message.trajectory.trajectory_id)

    async def pending() -> int:
        return (await bus.js.consumer_info(subjects.GRADED, durable)).num_ack_pending

    stop = asyncio.Event()
    consumer = asyncio.create_task(bus.consume(
        stream=subjects.GRADED, durable=durable, filter_subject=subjects.graded(run_id), handler=on_graded,
        message_type=GradedTrajectory, stop=stop, ack_wait=30, batch=8,
    ))  # fmt: skip
    try:
        await _until(lambda: _true(len(arrivals) == 5), "five held messages")
        await _until(lambda: _eq(pending(), 5), "the trained one acked on sight, five held")
        assert ledger.ready(group_size=2, groups_per_step=3, timeout_s=60) == ["g0", "g1"]  # g2 is incomplete
        groups = ledger.begin_step(["g0", "g1"])
        assert sorted(g.graded[0].trajectory.trajectory_id for g in groups) == ["g0-0", "g1-0"]
        ledger.step_trained(["g0-0", "g0-1", "g1-0", "g1-1"])
        assert await pending() == 5  # trained, not yet saved: nothing acked
        await ledger.saved()
        await _until(lambda: _eq(pending(), 1), "the saved step's four messages acked")
        assert ledger.trained >= {"g0-0", "g0-1", "g1-0", "g1-1"} and ledger.unsaved == []
        (held,) = ledger.held()  # g2-0: handed back, it comes again
        assert ledger.groups == {} and ledger.in_step == []
        await held.nak()
        await _until(lambda: _true(arrivals.count("g2-0") == 2), "the handed-back message redelivered")
        assert list(ledger.groups) == ["g2"]
        assert await ledger.drop("g2") == 1  # a group that carries no signal is acked untrained
        await _until(lambda: _eq(pending(), 0), "every message acked")
    finally:
        stop.set()
        await consumer
        await bus.js.delete_consumer(subjects.GRADED, durable)


async def test_a_step_that_trains_nothing_acks_its_messages_untrained(bus: Bus) -> None:
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    durable = subjects.trainer_run_durable(run_id)
    for index in range(2):
        message = graded(run_id, "g", index, float(index), "grep")
        await bus.publish(
            subjects.graded(run_id), message, msg_id=f"{run_id}/{message.trajectory.trajectory_id}"
        )
    ledger = Ledger()

    async def on_graded(message: GradedTrajectory, delivery: Delivery) -> None:
        ledger.hold(message, delivery, keep_alive_s=5.0)

    async def pending() -> int:
        return (await bus.js.consumer_info(subjects.GRADED, durable)).num_ack_pending

    stop = asyncio.Event()
    consumer = asyncio.create_task(bus.consume(
        stream=subjects.GRADED, durable=durable, filter_subject=subjects.graded(run_id), handler=on_graded,
        message_type=GradedTrajectory, stop=stop, ack_wait=30, batch=8,
    ))  # fmt: skip
    try:
        await _until(
            lambda: _true(ledger.ready(group_size=2, groups_per_step=1, timeout_s=60) == ["g"]), "a group"
        )
        ledger.begin_step(["g"])
        await ledger.step_untrained()
        await _until(lambda: _eq(pending(), 0), "the step's messages acked untrained")
        assert ledger.trained == set() and ledger.held() == []
    finally:
        stop.set()
        await consumer
        await bus.js.delete_consumer(subjects.GRADED, durable)


async def _true(value: bool) -> bool:
    return value


async def _eq(awaitable, expected: int) -> bool:
    return await awaitable == expected
