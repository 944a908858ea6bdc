"""Session leases in Redis: every session has a key with a TTL (its value: the replica holding it),
renewed by its calls, and every replica a set of the sessions it holds, so that a restarted replica
releases whatever its earlier run held.

The replica's own registry decides: a session is reaped when its local idle deadline passes (every call
renews both), never because its key is gone. Redis only mirrors the registry, and the reaper puts back
what Redis lost (a flush, a failover) on its next round. When Redis is unreachable the service keeps
serving.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
import redis.exceptions
import structlog

from crucible.contracts import keys

log = structlog.get_logger("crucible.sandbox.leases")
RedisError = (redis.exceptions.RedisError, OSError)


class Leases:
    def __init__(self, client: aioredis.Redis, *, replica: str) -> None:
        self.redis = client
        self.replica = replica
        self._renewed: dict[str, float] = {}
        self._renewing: set[asyncio.Future] = set()

    async def grant(self, session_id: str, ttl_s: float) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.sandbox_lease_key(session_id), self.replica, px=int(ttl_s * 1000))
            pipe.sadd(keys.sandbox_sessions_key(self.replica), session_id)
            await pipe.execute()
        self._renewed[session_id] = time.monotonic()

    def renew(self, session_id: str, ttl_s: float) -> None:
        """Extend the lease in the background, at most once per tenth of its TTL: a call on the session
        neither waits for Redis nor, when it is busy, costs Redis anything."""
        if time.monotonic() - self._renewed.get(session_id, 0.0) < ttl_s / 10:
            return
        self._renewed[session_id] = time.monotonic()
        task = asyncio.ensure_future(
            self.redis.pexpire(keys.sandbox_lease_key(session_id), int(ttl_s * 1000))
        )
        self._renewing.add(task)
        task.add_done_callback(self._renewal_done)

    def _renewal_done(self, task: asyncio.Future) -> None:
        self._renewing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("cannot renew a lease (Redis unreachable)", error=str(task.exception()))

    async def restore(self, remaining_s: dict[str, float]) -> list[str]:
        """Grant again, for its remaining time, the lease of each live session (id: seconds left) that
        Redis no longer has; returns the ids restored."""
        if not remaining_s:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id, left in remaining_s.items():
                pipe.set(
                    keys.sandbox_lease_key(session_id), self.replica, px=max(int(left * 1000), 1), nx=True
                )
            pipe.sadd(keys.sandbox_sessions_key(self.replica), *remaining_s)
            found = await pipe.execute()
        return [s for s, restored in zip(remaining_s, found[:-1], strict=True) if restored]

    async def drop(self, session_id: str, *, replica: str | None = None) -> None:
        self._renewed.pop(session_id, None)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.sandbox_lease_key(session_id))
            pipe.srem(keys.sandbox_sessions_key(replica or self.replica), session_id)
            await pipe.execute()

    async def release_all(self, replica: str) -> int:
        """Drop every lease `replica` held (its earlier run, or a dead replica); return how many."""
        key = keys.sandbox_sessions_key(replica)
        held = [m.decode() if isinstance(m, bytes) else m for m in await self.redis.smembers(key)]
        async with self.redis.pipeline(transaction=True) as pipe:
            for session_id in held:
                pipe.delete(keys.sandbox_lease_key(session_id))
            pipe.delete(key)
            await pipe.execute()
        return len(held)
