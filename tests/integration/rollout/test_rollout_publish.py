"""A finished episode's trajectory is not lost to a NATS restart: the rollout waits it out and publishes;
and reading the run's end meanwhile says NATS is away (which the rollout waits out), not something else."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from prometheus_client import REGISTRY

from crucible.bus import Bus, BusUnavailable
from crucible.contracts import decode, packing, subjects
from crucible.contracts.messages import Trajectory
from crucible.localstack.servers import start_nats
from crucible.runs import run_end
from services.rollout.publish import publish_trajectory

pytestmark = pytest.mark.integration


def retries() -> float:
    labels = {"work": f"publish {subjects.ROLLOUTS}"}
    return REGISTRY.get_sample_value("crucible_outage_retries_total", labels) or 0.0


async def test_a_trajectory_finished_while_nats_restarts_is_published_once_it_is_back(
    tmp_path, common_settings, store
):
    server = start_nats(state_dir=tmp_path)
    bus = await Bus.connect(common_settings(nats_url=server.url), store=store, name="test-rollout-publish")
    restarted = None
    try:
        await bus.ensure_streams()
        run_id = f"run-{uuid.uuid4().hex[:8]}"
        trajectory = Trajectory(
            run_id=run_id, trajectory_id=uuid.uuid4().hex, group_id="g0", task_id="t", taskset="pybugs",
            tokens=packing.pack("u32", [1, 2]), logprobs=packing.pack("f32", [0.0, -0.5]),
            versions=packing.pack("u32", [0, 0]), loss_mask=packing.pack("u8", [0, 1]),
            constraints=packing.pack("u8", [0, 0]), final_diff="",
        )  # fmt: skip
        server.stop()
        with pytest.raises(BusUnavailable):
            await run_end(bus, run_id)
        before = retries()
        publishing = asyncio.create_task(publish_trajectory(bus, trajectory, stop=asyncio.Event()))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while retries() == before:  # the first try failed against the stopped server
            assert loop.time() < deadline and not publishing.done(), "the publish was never retried"
            await asyncio.sleep(0.05)
        restarted = start_nats(
            state_dir=tmp_path, port=server.port
        )  # the same streams, where clients reconnect
        assert await asyncio.wait_for(publishing, timeout=60) is True
        stored = await bus.js.get_last_msg(subjects.ROLLOUTS, subjects.rollouts(run_id))
        assert decode(stored.data, Trajectory) == trajectory
        info = await bus.js.stream_info(subjects.ROLLOUTS, subjects_filter=subjects.rollouts(run_id))
        assert info.state.subjects == {
            subjects.rollouts(run_id): 1
        }  # a retry the server had taken is dropped
    finally:
        await bus.close()
        (restarted or server).stop()
