"""Dead letters, inspected and replayed: a message its consumer could not process is parked with the
reason; `crucible deadletters list/show` find it, `replay` puts it back on its subject where the (now
fixed) consumer processes it, and the letter is gone; replaying it again is a clear error."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from cli_runner import crucible

from crucible.bus import Bus
from crucible.contracts import ContractError, subjects
from crucible.contracts.messages import Message

pytestmark = pytest.mark.integration


class Order(Message, tag="test.order.v1"):
    item: str


async def _consume(bus: Bus, subject: str, durable: str, handler, until) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(
        bus.consume(
            stream=subjects.EVENTS,
            durable=durable,
            filter_subject=subject,
            handler=handler,
            message_type=Order,
            stop=stop,
            max_deliver=2,
        )
    )
    for _ in range(200):  # observed: the condition, or 10 s
        if await until():
            break
        await asyncio.sleep(0.05)
    stop.set()
    await task


async def _letter_of(bus: Bus, subject: str):
    return next(((seq, letter) for seq, letter in await bus.dead_letters(stream=subjects.EVENTS, limit=500)
                 if letter.subject == subject), None)  # fmt: skip


async def test_a_dead_letter_is_listed_shown_replayed_and_processed(bus, common_settings):
    subject = subjects.events(f"run-{uuid.uuid4().hex[:12]}", "order")
    durable = f"orders-{uuid.uuid4().hex[:8]}"
    await bus.publish(subject, Order(item="widget"), msg_id=f"order-{uuid.uuid4().hex}")

    async def broken(message: Order, delivery) -> None:
        raise ContractError(f"cannot price {message.item}")

    await _consume(bus, subject, durable, broken, until=lambda: _letter_of(bus, subject))
    seq, letter = await _letter_of(bus, subject)
    assert "cannot price widget" in letter.reason and letter.consumer == durable

    env = {"CRUCIBLE_NATS_URL": common_settings().nats_url}
    listed = crucible("deadletters", "list", "--stream", subjects.EVENTS, "--limit", "500", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert {"seq": seq, "subject": subject} in [
        {"seq": r["seq"], "subject": r["subject"]} for r in json.loads(listed.stdout)
    ]
    shown = crucible("deadletters", "show", str(seq), env=env)
    assert shown.returncode == 0 and json.loads(shown.stdout)["message"]["item"] == "widget"

    replayed = crucible("deadletters", "replay", str(seq), env=env)
    assert replayed.returncode == 0 and f"replayed on {subject}" in replayed.stdout
    processed: list[str] = []

    async def fixed(message: Order, delivery) -> None:
        processed.append(message.item)

    async def done() -> bool:
        return bool(processed)

    await _consume(bus, subject, durable, fixed, until=done)
    assert processed == ["widget"]
    assert await _letter_of(bus, subject) is None
    again = crucible("deadletters", "replay", str(seq), env=env)
    assert again.returncode == 1 and "replayed already" in again.stderr
