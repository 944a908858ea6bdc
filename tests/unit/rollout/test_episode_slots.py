"""A rollout replica's episode slots: groups and evaluated tasks take what they hold, first come first
served, and give back what they no longer hold."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout.slots import EpisodeSlots


async def queued(slots: EpisodeSlots, n: int) -> None:
    """Until n requests wait in the slots' queue (yielding to the tasks that make them)."""
    while len(slots._waiting) < n:
        await asyncio.sleep(0)


async def test_requests_that_fit_are_served_at_once_and_others_wait_in_order():
    slots = EpisodeSlots(10)
    first, second = await slots.take(5), await slots.take(5)  # two groups of 4 with their parents
    assert slots.free == 0
    big = asyncio.create_task(slots.take(8))
    small = asyncio.create_task(slots.take(1))
    await queued(slots, 2)
    assert not big.done() and not small.done()
    first.release(1)  # a parent closed: 1 free, but the big request came first
    assert len(slots._waiting) == 2 and slots.free == 1  # nothing granted: `release` wakes in order
    first.close()
    second.close()
    held_big, held_small = await big, await small
    assert (held_big.count, held_small.count, slots.free) == (8, 1, 1)
    held_big.close()
    held_small.close()
    assert slots.free == 10


async def test_a_request_larger_than_the_capacity_takes_all_of_it():
    slots = EpisodeSlots(4)
    held = await slots.take(65)  # a group of 64 with its parent
    assert held.count == 4 and slots.free == 0
    held.release(10)  # keeps one until it is closed
    assert held.count == 1 and slots.free == 3
    held.close()
    held.close()  # idempotent
    assert slots.free == 4


async def test_a_cancelled_waiter_leaves_the_queue_and_lets_the_next_one_in():
    slots = EpisodeSlots(4)
    held = await slots.take(3)
    blocked = asyncio.create_task(slots.take(4))
    behind = asyncio.create_task(slots.take(1))
    await queued(slots, 2)
    assert not behind.done()
    blocked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await blocked
    assert (await behind).count == 1 and slots.free == 0
    held.close()
    assert slots.free == 3


async def test_a_held_block_gives_its_slots_back_when_it_raises():
    slots = EpisodeSlots(2)
    with pytest.raises(RuntimeError):
        async with slots.held(2):
            raise RuntimeError("an episode failed")
    assert slots.free == 2
