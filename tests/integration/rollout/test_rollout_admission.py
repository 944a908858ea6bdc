"""Group admission in real Redis: every live group has its own index, whatever the interleaving of
admissions and releases across replicas; released indices are reused within the staleness limit; the
trainer's refills (groups dropped for equal rewards) raise both the limit and the budget."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest
import redis.asyncio as aioredis

from crucible.contracts.keys import admitted_key, finished_key, refills_key, released_key
from crucible.contracts.runconfig import RunConfig
from crucible.rl.staleness import admission_limit
from services.rollout.admission import budget_spent, group_budget, release, try_admit

pytestmark = pytest.mark.integration


@pytest.fixture
async def run_id(redis_client):
    run = f"admission-{uuid.uuid4().hex[:12]}"
    yield run
    await redis_client.delete(admitted_key(run), released_key(run), refills_key(run), finished_key(run))


def _config(**schedule) -> RunConfig:
    return RunConfig.model_validate({"schedule": schedule})


def _limit(config: RunConfig, version: int) -> int:
    s = config.schedule
    return admission_limit(
        version=version,
        max_staleness=s.max_staleness,
        groups_per_step=s.groups_per_step,
        publish_every=s.publish_every,
    )


@pytest.fixture
async def replicas(redis_url):
    """One client per rollout replica (each pool holds at most 100 connections)."""
    clients = [aioredis.from_url(redis_url) for _ in range(4)]
    yield clients
    for client in clients:
        await client.aclose()


async def test_concurrent_admissions_and_releases_never_share_a_live_index(redis_client, replicas, run_id):
    config = _config(max_steps=40, groups_per_step=2, publish_every=1, max_staleness=1)
    rng = random.Random(0)
    live: set[int] = set()
    admitted, released = [], []
    duplicates: list[int] = []
    over_limit: list[tuple[int, int]] = []

    async def admit(redis: aioredis.Redis, version: int, start: float) -> None:
        await asyncio.sleep(start)
        index = await try_admit(redis=redis, run_id=run_id, config=config, version=version)
        if index is None:
            return
        if index in live:
            duplicates.append(index)
        if index >= _limit(config, version):
            over_limit.append((index, version))
        live.add(index)
        admitted.append(index)

    async def release_one(redis: aioredis.Redis, start: float) -> None:
        await asyncio.sleep(start)
        if not live:
            return
        index = rng.choice(sorted(live))
        live.discard(index)  # not live from here on: an admission answered after this may reuse it
        released.append(index)
        await release(redis=redis, run_id=run_id, index=index)

    # Rounds of 200 staggered, overlapping operations (~200 ms each, a dozen per 5 ms window), until
    # enough releases found a live index to exercise reuse: on a loaded machine the first round's
    # releases may mostly come before any admission answered.
    for _ in range(10):
        operations = []
        for i in range(200):
            redis, start = replicas[i % len(replicas)], i * 0.001 + rng.random() * 0.005
            if i < 20 or rng.random() < 0.6:
                operations.append(admit(redis, rng.randrange(0, 6), start))
            else:
                operations.append(release_one(redis, start))
        await asyncio.gather(*operations)
        if len(released) > 20 and len(admitted) > len(set(admitted)):
            break

    assert not duplicates, f"indices admitted twice while live: {duplicates}"
    assert not over_limit, f"indices admitted past the caller's staleness limit: {over_limit}"
    assert len(released) > 20 and len(admitted) > len(set(admitted)), "the test should reuse released indices"
    count = int(await redis_client.get(admitted_key(run_id)))
    waiting = {int(i) for i in await redis_client.smembers(released_key(run_id))}
    assert count <= group_budget(config)
    assert not waiting & live
    # every index handed out is either live or waiting to be reused: none is lost, none is made twice
    assert waiting | live == set(range(count))
    assert 0 < await redis_client.ttl(admitted_key(run_id)) <= 86400
    if waiting:
        assert 0 < await redis_client.ttl(released_key(run_id)) <= 86400


async def test_a_released_index_is_reused_before_a_new_one(redis_client, run_id):
    config = _config(max_steps=10, groups_per_step=2, publish_every=1, max_staleness=1)

    def admit(version: int = 0):
        return try_admit(redis=redis_client, run_id=run_id, config=config, version=version)

    assert [await admit() for _ in range(3)] == [0, 1, 2]
    await release(redis=redis_client, run_id=run_id, index=1)
    assert await admit() == 1
    assert await admit() == 3
    assert await admit() is None  # the staleness limit of version 0: (0 + 1 + 1) * 1 * 2 = 4 groups


async def test_a_released_index_past_a_stale_callers_limit_waits_for_a_newer_one(redis_client, run_id):
    config = _config(max_steps=10, groups_per_step=2, publish_every=1, max_staleness=0)

    def admit(version: int):
        return try_admit(redis=redis_client, run_id=run_id, config=config, version=version)

    assert [await admit(2) for _ in range(6)] == [0, 1, 2, 3, 4, 5]  # version 2 may take 6 groups
    await release(redis=redis_client, run_id=run_id, index=5)
    await release(redis=redis_client, run_id=run_id, index=1)
    assert await admit(0) == 1  # version 0 may take indices below 2
    assert await admit(0) is None  # index 5 would be trained too late for version 0
    assert await admit(2) == 5
    assert await admit(2) is None


async def test_budget_is_spent_only_when_no_released_index_waits(redis_client, run_id):
    config = _config(max_steps=1, groups_per_step=2, publish_every=1, max_staleness=5)
    budget = group_budget(config)
    assert budget == 4
    for expected in range(budget):
        assert not await budget_spent(redis=redis_client, run_id=run_id, config=config)
        assert await try_admit(redis=redis_client, run_id=run_id, config=config, version=0) == expected
    assert await budget_spent(redis=redis_client, run_id=run_id, config=config)
    assert await try_admit(redis=redis_client, run_id=run_id, config=config, version=0) is None
    await release(redis=redis_client, run_id=run_id, index=2)
    assert not await budget_spent(redis=redis_client, run_id=run_id, config=config)
    assert await try_admit(redis=redis_client, run_id=run_id, config=config, version=0) == 2
    assert await budget_spent(redis=redis_client, run_id=run_id, config=config)


async def test_refills_raise_both_the_staleness_limit_and_the_budget(redis_client, run_id):
    config = _config(max_steps=1, groups_per_step=1, publish_every=1, max_staleness=0)
    assert group_budget(config) == 2 and _limit(config, 0) == 1

    def admit(version: int):
        return try_admit(redis=redis_client, run_id=run_id, config=config, version=version)

    def spent():
        return budget_spent(redis=redis_client, run_id=run_id, config=config)

    assert await admit(0) == 0
    assert await admit(0) is None  # the staleness limit of version 0
    await redis_client.incr(refills_key(run_id))  # the trainer dropped a group
    assert await admit(0) == 1  # the limit rose by one
    assert await admit(0) is None
    assert await spent() is False  # budget 2 + 1 refill, two taken

    assert await admit(5) == 2  # version 5's limit is far off: the budget (2 + 1) binds
    assert await admit(5) is None
    assert await spent() is True
    assert 0 < await redis_client.ttl(refills_key(run_id)) <= 86400  # admission keeps the key's TTL

    await redis_client.incr(refills_key(run_id))
    assert await spent() is False  # the budget rose by one
    assert await admit(5) == 3
    assert await spent() is True
