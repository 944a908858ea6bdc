"""Session leases in Redis: every session has a key with a TTL, renewed by its calls, and every replica
a heartbeat. A replica's reaper destroys its sessions whose lease lapsed (a crashed rollout never
destroys its sandboxes); a replica that restarts releases whatever its earlier run held; and a
replica whose heartbeat lapsed has its leftovers on this machine swept by any live one.

Redis is coordination only: when it is unreachable, sessions fall back to their local idle deadline
and the service keeps serving.
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

    async def heartbeat(self, ttl_s: float) -> None:
        await self.redis.set(keys.sandbox_replica_key(self.replica), "1", px=int(ttl_s * 1000))

    async def alive(self, replica: str) -> bool:
        return bool(await self.redis.exists(keys.sandbox_replica_key(replica)))

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

    async def lapsed(self, session_ids: list[str]) -> list[str]:
        if not session_ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id in session_ids:
                pipe.exists(keys.sandbox_lease_key(session_id))
            found = await pipe.execute()
        return [s for s, alive in zip(session_ids, found, strict=True) if not alive]

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
