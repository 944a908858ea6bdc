"""The episodes one rollout replica runs at once, over all its runs and evaluations.

A slot is a sandbox session the replica holds (and the episode's KV slot in its engine). A run's group
takes `group_size + 1` slots while its task's sandbox is forked, then gives the parent's back; an
evaluated task likewise. Requests are served first come, first served, so a large one is never passed
over by smaller ones forever; one larger than the whole capacity takes all of it (and runs alone).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator


class EpisodeSlots:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.free = capacity
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    async def _acquire(self, n: int) -> None:
        if not self._waiting and self.free >= n:
            self.free -= n
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((n, future))
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():  # granted as it was cancelled: give it back
                self._release(n)
            else:
                self._waiting.remove((n, future))
                self._wake()
            raise

    def _release(self, n: int) -> None:
        self.free += n
        assert self.free <= self.capacity, "released more slots than were taken"
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self._waiting[0][0] <= self.free:
            n, future = self._waiting.popleft()
            self.free -= n
            future.set_result(None)

    async def take(self, n: int) -> Held:
        """n slots (at most the capacity), once they are free; give them back with `Held.close`."""
        held = Held(self, min(n, self.capacity))
        await self._acquire(held.count)
        return held

    @contextlib.asynccontextmanager
    async def held(self, n: int) -> AsyncIterator[Held]:
        held = await self.take(n)
        try:
            yield held
        finally:
            held.close()


class Held:
    def __init__(self, slots: EpisodeSlots, count: int) -> None:
        self._slots = slots
        self.count = count

    def release(self, n: int) -> None:
        """Give back n of the held slots now (keeping at least one until `close`)."""
        n = min(n, self.count - 1)
        if n > 0:
            self.count -= n
            self._slots._release(n)

    def close(self) -> None:
        """Give back every held slot; idempotent."""
        count, self.count = self.count, 0
        if count:
            self._slots._release(count)
