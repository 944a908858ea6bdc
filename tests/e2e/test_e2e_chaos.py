"""Chaos on a live stack: each of the seven services killed with SIGKILL while it holds work, nats-server,
the S3 server and Redis stopped and started again, and Redis flushed, all during one run. Each fault waits
for an observed condition (a consumer's unacknowledged message, a group in flight, a live sandbox
session), each recovery is timed to the next sign of progress, and at the end the run has finished
with every trajectory graded once and trained at most once, and nothing dead-lettered.

The stack is the test's own (`LocalStack` starts its own NATS, S3 and Redis), so nothing it does can
reach another test's streams. The recovery times are printed; docs/operations.md records them."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable

import httpx
import nats
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from crucible.contracts import subjects
from crucible.localstack import LocalStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONFIG = {
    "schedule": {
        "group_size": 2,
        "groups_per_step": 2,
        "max_steps": 40,
        "publish_every": 1,
        "max_staleness": 1,
    },
    "agent": {"max_turns": 2},
}
SERVICE_ENV = {
    "grader": {"CRUCIBLE_ACK_WAIT_S": "8", "CRUCIBLE_HEARTBEAT_S": "2"},
    # Groups lost with a killed rollout or sandbox are replaced after 20 s without graded work.
    "trainer": {"CRUCIBLE_ACK_WAIT_S": "6", "CRUCIBLE_HEARTBEAT_S": "2", "CRUCIBLE_GROUP_TIMEOUT_S": "20"},
}
FAULT_TIMEOUT_S = 240.0


class Chaos:
    """The stack, a NATS connection of the test's own, and what each fault cost."""

    def __init__(self, stack: LocalStack, js, http: httpx.AsyncClient, run_id: str) -> None:
        self.stack, self.js, self.http, self.run_id = stack, js, http, run_id
        self.recovery: dict[str, dict[str, float]] = {}

    async def until(
        self, what: str, condition: Callable[[], Awaitable[bool]], *, every_s: float = 0.2
    ) -> None:
        deadline = time.monotonic() + FAULT_TIMEOUT_S
        while not await condition():
            dead = self.stack.poll()
            assert not dead, f"exited while waiting for {what}: {dead}\n" + "\n".join(
                f"--- {name}:\n{self.stack.log_tail(name, lines=60)}" for name, _ in dead
            )
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(every_s)

    async def ack_pending(self, stream: str, durable: str) -> int:
        try:
            return (await self.js.consumer_info(stream, durable)).num_ack_pending
        except Exception:  # not created yet, or the server is restarting
            return 0

    async def metric(self, service: str, name: str) -> float:
        port = self.stack.service(service).http_port
        try:
            text = (await self.http.get(f"http://127.0.0.1:{port}/metrics")).text
        except httpx.HTTPError:
            return 0.0
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and sample.labels.get("run_id", self.run_id) == self.run_id
        )

    async def graded(self) -> int:
        info = await self.js.stream_info(subjects.GRADED, subjects_filter=subjects.graded(self.run_id))
        return (info.state.subjects or {}).get(subjects.graded(self.run_id), 0)

    async def ingested(self) -> int:
        return len(await pages(self.http, f"/v1/runs/{self.run_id}/trajectories"))

    async def steps(self) -> int:
        return len(await pages(self.http, f"/v1/runs/{self.run_id}/steps"))

    async def recovered(
        self, fault: str, progress: Callable[[], Awaitable[int]], before: int, started: float, back: float
    ) -> None:
        """Record the fault's seconds: until the service or server was back (`back`), and until the
        next progress past `before`, both from the fault's start."""

        async def moved() -> bool:
            try:
                return await progress() > before
            except (httpx.HTTPError, nats.errors.Error, TimeoutError):
                return False

        await self.until(f"progress after the {fault}", moved)
        self.recovery[fault] = {
            "back_s": round(back - started, 1),
            "progress_s": round(time.monotonic() - started, 1),
        }

    async def kill(self, service: str, holding: Callable[[], Awaitable[bool]], progress) -> None:
        """SIGKILL `service` once `holding()` is observed, restart it, and time the recovery."""
        await self.until(f"{service} to hold work", holding, every_s=0.01 if service == "api" else 0.2)
        before = await progress()
        started = time.monotonic()
        self.stack.kill(service, signal.SIGKILL)
        await self.stack.arestart(service)
        await self.recovered(f"{service} SIGKILL", progress, before, started, time.monotonic())

    async def outage(self, server: str, down: Callable[[], Awaitable[bool]]) -> None:
        """Stop an embedded server, wait until the services notice, start it again; time the recovery."""
        before = await self.graded_or_zero()
        await asyncio.to_thread(self.stack.stop_server, server)
        await self.until(f"the services to notice {server} is down", down)
        started = time.monotonic()  # the outage's end: the server starts again
        await asyncio.to_thread(self.stack.start_server, server)
        await self.recovered(f"{server} restart", self.graded, before, started, time.monotonic())

    async def graded_or_zero(self) -> int:
        try:
            return await self.graded()
        except (nats.errors.Error, TimeoutError):
            return 0


async def pages(http: httpx.AsyncClient, path: str) -> list[dict]:
    items, cursor = [], None
    while True:
        page = await http.get(path, params={"limit": 200, **({"cursor": cursor} if cursor else {})})
        page.raise_for_status()
        items.extend(page.json()["items"])
        cursor = page.json()["next_cursor"]
        if cursor is None:
            return items


async def not_ready(http: httpx.AsyncClient, stack: LocalStack, service: str) -> bool:
    try:
        return (await http.get(stack.service(service).readyz_url)).status_code == 503
    except httpx.HTTPError:
        return False


async def test_every_service_killed_and_every_server_restarted_mid_run_loses_nothing(tmp_path):
    async with LocalStack(api_port=0, state_dir=tmp_path / "stack", service_env=SERVICE_ENV) as stack:
        nc = await nats.connect(**stack.nats_options, max_reconnect_attempts=-1, reconnect_time_wait=0.5)
        http = httpx.AsyncClient(base_url=stack.api_url, headers=stack.api_headers, timeout=30)
        try:
            created = await http.post("/v1/runs", json={"name": "chaos", "config": CONFIG})
            assert created.status_code == 201, created.text
            run_id = created.json()["run_id"]
            chaos = Chaos(stack, nc.jetstream(), http, run_id)

            await chaos.kill(
                "grader",
                lambda: _at_least(chaos.ack_pending(subjects.ROLLOUTS, subjects.GRADER_DURABLE)),
                chaos.graded,
            )
            await chaos.kill(
                "trainer",
                lambda: _at_least(chaos.ack_pending(subjects.GRADED, subjects.trainer_run_durable(run_id))),
                chaos.steps,
            )
            await chaos.kill(
                "api",
                lambda: _at_least(chaos.ack_pending(subjects.GRADED, subjects.API_GRADED_DURABLE),
                                  chaos.ack_pending(subjects.EVENTS, subjects.API_EVENTS_DURABLE)),
                chaos.ingested,
            )  # fmt: skip
            in_flight = lambda: _at_least(chaos.metric("rollout", "crucible_rollout_groups_in_flight"))  # noqa: E731
            await chaos.kill("rollout", in_flight, chaos.graded)
            await chaos.kill(
                "sandbox",
                lambda: _at_least(chaos.metric("sandbox", "crucible_sandbox_sessions")),
                chaos.graded,
            )
            # The catalog and the checkpoints service answer requests and hold nothing between them; they
            # die while their callers hold work: a group in flight, a step about to publish its weights.
            await chaos.kill("catalog", in_flight, chaos.graded)
            steps = await chaos.steps()
            await chaos.kill("checkpoints", lambda: _at_least(chaos.steps(), floor=steps + 1), chaos.steps)

            await chaos.outage("nats", lambda: not_ready(http, stack, "grader"))
            await chaos.outage("seaweedfs", lambda: not_ready(http, stack, "grader"))
            await chaos.outage("redis", lambda: not_ready(http, stack, "rollout"))
            await chaos.until("a group in flight before the Redis flush", in_flight)
            before = await chaos.graded()
            redis = aioredis.from_url(stack.settings_env["CRUCIBLE_REDIS_URL"])
            try:
                started = time.monotonic()
                assert await redis.flushall() is True
            finally:
                await redis.aclose()
            await chaos.recovered("redis flush", chaos.graded, before, started, started)

            async def ended() -> bool:
                return (await http.get(f"/v1/runs/{run_id}")).json()["status"] in (
                    "finished",
                    "failed",
                    "cancelled",
                )

            await chaos.until("the run to end", ended, every_s=1.0)
            run = (await http.get(f"/v1/runs/{run_id}")).json()
            assert run["status"] == "finished", run

            async def settled() -> bool:  # spare groups graded, and all of it ingested
                subject = subjects.rollouts(run_id)
                rollouts = await chaos.js.stream_info(subjects.ROLLOUTS, subjects_filter=subject)
                waiting = (rollouts.state.subjects or {}).get(subject, 0)
                return waiting == 0 and await chaos.ingested() == await chaos.graded()

            await chaos.until("every trajectory graded and ingested", settled, every_s=1.0)
            trajectories = await pages(http, f"/v1/runs/{run_id}/trajectories")
            steps_out = await pages(http, f"/v1/runs/{run_id}/steps")
            dead = await chaos.js.stream_info(subjects.DEAD_LETTER)
            assert dead.state.messages == 0, "nothing may be dead-lettered for an outage or a crash"
            assert all(t["graded_count"] == 1 for t in trajectories)
            assert all(t["trained_count"] <= 1 for t in trajectories)
            trained = [tid for s in steps_out for tid in s["trajectory_ids"]]
            assert len(trained) == len(set(trained)) > 0
            assert set(trained) <= {t["trajectory_id"] for t in trajectories}
            assert [s["step"] for s in steps_out] == list(range(1, CONFIG["schedule"]["max_steps"] + 1))
            print("recovery_s", json.dumps(chaos.recovery))
        finally:
            await http.aclose()
            await nc.close()


async def _at_least(*values: Awaitable[float], floor: float = 1) -> bool:
    return any(v >= floor for v in await asyncio.gather(*values))
