"""The trainer service on a worker group of four ranks (expert-parallel 2 x sharded data-parallel 2,
gloo) trains a run through the services as one rank does: the same graded groups give the same step
losses within fp32 tolerance, with local processes and with Ray actors in a local Ray cluster; and a
rank killed with SIGKILL mid-run costs the run nothing: the trainer resumes it from its sharded state in
a fresh group, and every trajectory ends up trained exactly once."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import msgspec
import pytest
from nats.js.api import DeliverPolicy
from test_trainer_service import _finished, graded

from crucible.bus import Bus
from crucible.contracts import subjects
from crucible.contracts.events import Event, StepReport
from crucible.contracts.keys import trainer_state_key
from crucible.contracts.messages import RunCreated, RunFinished
from crucible.contracts.runconfig import RunConfig
from crucible.localstack.servers import start_nats
from crucible.runtime import running
from services.checkpoints.app import setup as checkpoints_setup
from services.checkpoints.settings import Settings as CheckpointsSettings
from services.trainer.app import setup as trainer_setup
from services.trainer.settings import Settings as TrainerSettings
from services.trainer.state import SavedState

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

STEPS = 3
FOUR = {"world_size": 4, "ep": 2, "dp_shard": 2}
# fp32 across rank layouts: the layout changes the order of the sums each value passes through (the
# loss's shares all-reduced, gradients reduce-scattered, matmuls blocked over fewer rows), which moves a
# sum of D terms by at most about D x 2^-24 of their magnitudes. D is the longest such reduction: the
# tiny preset's vocabulary (320) outnumbers a step's tokens (4 trajectories of 10) and its width (128).
FP32_REL_TOL = 320 * 2.0**-24


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    server = start_nats(state_dir=tmp_path_factory.mktemp("parallel-trainer-nats"))
    yield server.url
    server.stop()


def _config(parallel: dict) -> RunConfig:
    return RunConfig.model_validate({
        "parallel": parallel,
        "model": {"precision": "fp32"},  # bf16 matmuls round differently as the rows per rank change
        "optim": {"learning_rate": 1e-4},
        "schedule": {"group_size": 2, "groups_per_step": 2, "max_steps": STEPS, "publish_every": 1},
    })  # fmt: skip


async def _start(bus: Bus, parallel: dict) -> tuple[str, list[str]]:
    """A run whose graded groups are all in the stream before it starts, so every run takes them in the
    same order: group i holds two attempts at one tool, rewarded differently."""
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    ids = []
    for i in range(2 * STEPS):
        for index, reward in enumerate((float(i % 3), 1.0 - i % 2)):
            message = graded(
                run_id, f"g{i}", index, reward, ("grep", "read_file", "list_dir")[(i + index) % 3]
            )
            ids.append(message.trajectory.trajectory_id)
            await bus.publish(subjects.graded(run_id), message, msg_id=f"{run_id}/{ids[-1]}")
    created = RunCreated(run_id=run_id, name="parallel", config=_config(parallel), created_at=time.time())
    await bus.publish(subjects.run_created(run_id), created, msg_id=run_id)
    return run_id, ids


async def _steps(bus: Bus, run_id: str, count: int, *, timeout_s: float = 300) -> list[StepReport]:
    """The run's first `count` step reports, in order (a step trained again after a resume has the
    same de-duplication id: the stream keeps one report per step)."""
    sub = await bus.js.subscribe(
        subjects.events(run_id, "step"), ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
    )
    try:
        reports = []
        deadline = time.monotonic() + timeout_s
        while len(reports) < count:
            msg = await sub.next_msg(timeout=max(1.0, deadline - time.monotonic()))
            reports.append((await bus._unpack(msg.data, dict(msg.headers or {}), Event)).data)
        return reports
    finally:
        await sub.unsubscribe()


async def _train(rt, parallel: dict) -> tuple[list[tuple[float, float]], RunFinished]:
    run_id, _ = await _start(rt.bus, parallel)
    reports = await _steps(rt.bus, run_id, STEPS)
    ended = await _finished(rt.bus, run_id, timeout_s=300)
    return [(r.metrics["loss"], r.metrics["grad_norm"]) for r in reports], ended


def _rank_processes() -> list[int]:
    """This process's worker-group ranks: the children of its multiprocessing fork server."""

    def children(pid: int) -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry.name))
                except (OSError, IndexError, ValueError):
                    continue
        return found

    servers = [p for p in children(os.getpid()) if b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return sorted(rank for server in servers for rank in children(server))


async def test_four_ranks_take_the_steps_one_rank_takes_locally_and_on_ray(
    common_settings, ray_cluster
) -> None:
    trainer = common_settings(TrainerSettings, ack_wait_s=30, heartbeat_s=5, max_runs=1, step_timeout_s=300)
    async with (
        running("checkpoints", common_settings(CheckpointsSettings), checkpoints_setup),
        running("trainer", trainer, trainer_setup) as rt,
    ):
        one, one_end = await _train(rt, {})
        four, four_end = await _train(rt, FOUR)
        on_ray, ray_end = await _train(rt, {**FOUR, "launcher": "ray"})  # on the session's Ray cluster
    assert one_end.status == four_end.status == ray_end.status == "finished"
    for losses in (four, on_ray):  # (loss, gradient norm) of each step
        expected = [x for step in one for x in step]
        assert [x for step in losses for x in step] == pytest.approx(expected, rel=FP32_REL_TOL)
    assert len({loss for loss, _ in one}) == STEPS  # the steps differ: nothing compared is trivially equal


async def test_a_rank_killed_mid_run_costs_the_run_nothing(common_settings) -> None:
    trainer = common_settings(TrainerSettings, ack_wait_s=30, heartbeat_s=5, max_runs=1, step_timeout_s=300)
    async with (
        running("checkpoints", common_settings(CheckpointsSettings), checkpoints_setup),
        running("trainer", trainer, trainer_setup) as rt,
    ):
        bus: Bus = rt.bus
        run_id, ids = await _start(bus, FOUR)
        first = (await _steps(bus, run_id, 1))[0]  # step 1 trained and its state saved
        ranks = _rank_processes()
        assert len(ranks) == 4, ranks
        os.kill(ranks[-1], signal.SIGKILL)
        ended = await _finished(bus, run_id, timeout_s=300)
        reports = await _steps(bus, run_id, STEPS)
        slots = []
        for slot in (0, 1):
            data = await rt.store.get_bytes(rt.store.uri(trainer_state_key(run_id, slot)), verify=False)
            slots.append(msgspec.json.decode(data, type=SavedState))
    assert ended.status == "finished" and ended.step == STEPS
    assert reports[0].metrics["loss"] == first.metrics["loss"]
    trained = [t for report in reports for t in report.trajectory_ids]
    assert sorted(trained) == sorted(ids)  # each trajectory in exactly one step: none lost, none twice
    final = max(slots, key=lambda s: s.step)
    assert final.step == STEPS and sorted(final.trained) == sorted(ids) and final.world_size == 4
    assert any(name.endswith(".distcp") for name in final.files)  # the ranks' own shard files
