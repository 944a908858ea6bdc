"""Staleness-bounded admission of new groups, counted in Redis across every rollout replica."""

from __future__ import annotations

import redis.asyncio as aioredis

from crucible.contracts.keys import DAY_S, admitted_key, finished_key
from crucible.contracts.runconfig import RunConfig
from crucible.rl.staleness import admission_limit

# Atomically take the next group index if it is below the limit.
_ADMIT = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n >= tonumber(ARGV[1]) then return -1 end
redis.call('SET', KEYS[1], n + 1, 'EX', ARGV[2])
return n
"""


def group_budget(config: RunConfig) -> int:
    """Groups a run needs, plus one step's worth of spare for groups lost to failures."""
    return (config.schedule.max_steps + 1) * config.schedule.groups_per_step


async def try_admit(*, redis: aioredis.Redis, run_id: str, config: RunConfig, version: int) -> int | None:
    """The admitted group's index, or None while admitting would break the staleness bound or budget."""
    limit = min(
        admission_limit(
            version=version,
            max_staleness=config.schedule.max_staleness,
            groups_per_step=config.schedule.groups_per_step,
            publish_every=config.schedule.publish_every,
        ),
        group_budget(config),
    )
    index = int(await redis.eval(_ADMIT, 1, admitted_key(run_id), limit, DAY_S))
    return None if index < 0 else index


async def release(*, redis: aioredis.Redis, run_id: str) -> None:
    """Give back an admitted group that produced nothing, so that a later try can take its place."""
    await redis.decr(admitted_key(run_id))


async def budget_spent(*, redis: aioredis.Redis, run_id: str, config: RunConfig) -> bool:
    if await redis.exists(finished_key(run_id)):
        return True
    return int(await redis.get(admitted_key(run_id)) or 0) >= group_budget(config)
