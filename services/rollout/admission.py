"""Staleness-bounded admission of new groups, counted in Redis across every rollout replica.

Group indices are handed out once each: `admitted` counts the indices ever taken, `released` holds those
given back by groups that produced nothing, and a new group reuses a released index before taking a new
one, so no two live groups share an index (the index seeds the group's task and episodes). Each group
the trainer drops for having equal rewards (`refills`, DAPO dynamic sampling) makes room for one more
group, within both the staleness limit and the run's budget.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from crucible.contracts.keys import DAY_S, admitted_key, finished_key, refills_key, released_key
from crucible.contracts.runconfig import RunConfig
from crucible.rl.staleness import admission_limit

# KEYS: admitted, released, refills. ARGV: staleness limit, budget, ttl (also kept on the trainer's refills).
# The lowest released index below the limit, else the next index if below the limit, else -1. A released
# index at or above this caller's limit (given back under a newer version's limit) is left for another.
_ADMIT = """
local refills = tonumber(redis.call('GET', KEYS[3]) or '0')
if refills > 0 then redis.call('EXPIRE', KEYS[3], ARGV[3]) end
local limit = math.min(tonumber(ARGV[1]), tonumber(ARGV[2])) + refills
local best = nil
for _, member in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local index = tonumber(member)
  if index < limit and (best == nil or index < best) then best = index end
end
if best ~= nil then
  redis.call('SREM', KEYS[2], tostring(best))
  return best
end
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n >= limit then return -1 end
redis.call('SET', KEYS[1], n + 1, 'EX', ARGV[3])
return n
"""

# KEYS: admitted, released, refills. ARGV: budget. 1 when every index of the budget is taken and none waits.
_SPENT = """
local refills = tonumber(redis.call('GET', KEYS[3]) or '0')
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n >= tonumber(ARGV[1]) + refills and redis.call('SCARD', KEYS[2]) == 0 then return 1 end
return 0
"""


def group_budget(config: RunConfig) -> int:
    """Groups a run needs, plus one step's worth of spare for groups lost to failures (before refills)."""
    if config.schedule.max_steps == 0:  # a warm start alone samples nothing
        return 0
    return (config.schedule.max_steps + 1) * config.schedule.groups_per_step


def _keys(run_id: str) -> list[str]:
    return [admitted_key(run_id), released_key(run_id), refills_key(run_id)]


async def try_admit(*, redis: aioredis.Redis, run_id: str, config: RunConfig, version: int) -> int | None:
    """The admitted group's index, or None while admitting would break the staleness bound or budget.

    Both the limit and the budget are raised by the trainer's refills, read in the same atomic script.
    """
    limit = admission_limit(
        version=version,
        max_staleness=config.schedule.max_staleness,
        groups_per_step=config.schedule.groups_per_step,
        publish_every=config.schedule.publish_every,
    )
    index = int(await redis.eval(_ADMIT, 3, *_keys(run_id), limit, group_budget(config), DAY_S))
    return None if index < 0 else index


async def release(*, redis: aioredis.Redis, run_id: str, index: int) -> None:
    """Give back admitted group `index`, which produced nothing, so that the next admission reuses it."""
    key = released_key(run_id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.sadd(key, index)
        pipe.expire(key, DAY_S)
        await pipe.execute()


async def budget_spent(*, redis: aioredis.Redis, run_id: str, config: RunConfig) -> bool:
    """The run is finished, or every group index of its budget (plus refills) is taken and none released."""
    if await redis.exists(finished_key(run_id)):
        return True
    return bool(int(await redis.eval(_SPENT, 3, *_keys(run_id), group_budget(config))))
