"""The trainer and checkpoints services in-process, on a NATS server of this module's own (the trainer's
durable on RUNS would otherwise take other tests' runs), with real S3 and Redis."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import torch

from crucible.agent import grammar, tokenizer
from crucible.bus import Bus
from crucible.contracts import subjects
from crucible.contracts.events import Event, StepReport
from crucible.contracts.keys import refills_key
from crucible.contracts.messages import GradedTrajectory, Reward, RunCreated, RunFinished, Trajectory
from crucible.contracts.packing import pack
from crucible.contracts.runconfig import RunConfig
from crucible.localstack.servers import start_nats
from crucible.model.hf import export_weights
from crucible.objectstore import ObjectStore
from crucible.outage import Unavailable
from crucible.runtime import running
from services.checkpoints.app import setup as checkpoints_setup
from services.checkpoints.settings import Settings as CheckpointsSettings
from services.trainer.app import setup as trainer_setup
from services.trainer.settings import Settings as TrainerSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    server = start_nats(state_dir=tmp_path_factory.mktemp("trainer-nats"))
    yield server.url
    server.stop()


def graded(run_id: str, group: str, index: int, reward: float, tool: str) -> GradedTrajectory:
    """One action `<act><tool:NAME><end>` after a short prompt; only the tool token was sampled."""
    tokens = [
        tokenizer.BOS,
        *tokenizer.encode("use it"),
        tokenizer.ACT,
        tokenizer.tool_token(tool),
        tokenizer.END,
    ]
    n = len(tokens)
    trajectory = Trajectory(
        run_id=run_id, trajectory_id=f"{group}-{index}", group_id=group, task_id="t", taskset="s",
        tokens=pack("u32", tokens), logprobs=pack("f32", [0.0] * (n - 2) + [-1.79, 0.0]),
        versions=pack("u32", [0] * n), loss_mask=pack("u8", [0] * (n - 2) + [1, 0]),
        constraints=pack("u8", [grammar.FREE] * (n - 2) + [grammar.TOOL, grammar.FREE]),
    )  # fmt: skip
    return GradedTrajectory(
        trajectory=trajectory,
        reward=Reward(total=reward, tests_passed=0, tests_total=1),
        graded_at=time.time(),
    )


async def one_step_run(bus: Bus, run_id: str, config: RunConfig, group: str) -> None:
    """Create the run and publish its one step's group: `group`'s two trajectories, rewards 0 and 1. Each
    test names its own group: the bus drops a message whose id another test of this module published."""
    created = RunCreated(run_id=run_id, name="x", config=config, created_at=time.time())
    await bus.publish(subjects.run_created(run_id), created)
    for message in (graded(run_id, group, 0, 0.0, "grep"), graded(run_id, group, 1, 1.0, "run")):
        await bus.publish(subjects.graded(run_id), message, msg_id=message.trajectory.trajectory_id)


async def test_dynamic_sampling_drops_uniform_groups_asks_for_refills_and_reports_them(
    common_settings, redis_url
) -> None:
    import redis.asyncio as aioredis

    run_id = f"run-{uuid.uuid4().hex[:12]}"
    config = RunConfig.model_validate(
        {
            "optim": {"drop_uniform_groups": True, "advantage": "rloo"},
            "schedule": {"group_size": 2, "groups_per_step": 1, "max_steps": 1, "publish_every": 1},
        }
    )
    trainer = common_settings(TrainerSettings, ack_wait_s=30, heartbeat_s=5)
    async with (
        running("checkpoints", common_settings(CheckpointsSettings), checkpoints_setup),
        running("trainer", trainer, trainer_setup) as rt,
    ):
        bus: Bus = rt.bus
        created = RunCreated(run_id=run_id, name="dapo", config=config, created_at=time.time())
        await bus.publish(subjects.run_created(run_id), created, msg_id=run_id)
        for message in (
            graded(run_id, "uniform", 0, 1.0, "grep"),
            graded(run_id, "uniform", 1, 1.0, "run"),
            graded(run_id, "mixed", 0, 0.0, "grep"),
            graded(run_id, "mixed", 1, 1.0, "submit"),
        ):
            await bus.publish(subjects.graded(run_id), message, msg_id=message.trajectory.trajectory_id)
        await _finished(bus, run_id)
        event = await bus.latest(subjects.EVENTS, subjects.events(run_id, "step"), Event)
    assert isinstance(event.data, StepReport)
    step = event.data
    assert step.step == 1 and sorted(step.trajectory_ids) == ["mixed-0", "mixed-1"]
    assert step.metrics["groups_dropped"] == 1.0 and step.metrics["groups_dropped_fraction"] == 0.5
    for name in ("clip_low_fraction", "clip_high_fraction", "ratio_p50", "kl_behaviour", "staleness_lag_0"):
        assert name in step.metrics, name
    redis = aioredis.from_url(redis_url)
    try:
        assert int(await redis.get(refills_key(run_id))) == 1
    finally:
        await redis.aclose()


async def test_a_published_version_exports_to_a_directory_transformers_loads(
    common_settings, tmp_path
) -> None:
    """`crucible model export --run RUN --version N` reads the version through the checkpoints service and
    the object store, and writes a checkpoint that transformers loads with the trainer's logits."""
    import torch
    import transformers
    from cli_runner import crucible

    from crucible.clients.checkpoints import load_weights
    from crucible.model import PRESETS, Transformer

    run_id = f"run-{uuid.uuid4().hex[:12]}"
    config = RunConfig.model_validate(
        # with a KL term: the trainer loads its reference from the published version 0 before training
        {
            "model": {"source": "tiny-dense"},
            "optim": {"kl_coef": 0.1},
            "schedule": {"group_size": 2, "groups_per_step": 1, "max_steps": 1},
        }
    )
    settings = common_settings(TrainerSettings, ack_wait_s=30, heartbeat_s=5)
    async with (
        running("checkpoints", common_settings(CheckpointsSettings), checkpoints_setup),
        running("trainer", settings, trainer_setup) as rt,
    ):
        bus: Bus = rt.bus
        await one_step_run(bus, run_id, config, "g")
        await _finished(bus, run_id)
        env = {f"CRUCIBLE_{k.upper()}": str(v) for k, v in settings.model_dump().items() if v is not None}
        out = tmp_path / "hf"
        done = await asyncio.to_thread(
            crucible, "model", "export", "--run", run_id, "--version", "1", "--out", str(out), env=env
        )
        assert done.returncode == 0, done.stderr
        _, state = await load_weights(bus=bus, store=rt.store, run_id=run_id, version=1)
    model = Transformer(PRESETS["tiny-dense"], precision="fp32")
    model.load_state_dict(state)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (reloaded(x).logits - model.eval()(x).logits).abs().max() <= 1e-4


async def test_a_lora_run_publishes_its_adapters_as_deltas_and_exports_merged_and_as_a_peft_adapter(
    common_settings, tmp_path
) -> None:
    """model.lora through the trainer and checkpoints services: version 0 is a full snapshot, version 1 a
    delta holding the adapters' bytes and little else (the frozen base compresses to nothing, its bits
    unchanged), and `crucible model export --run` writes merged weights transformers loads and
    `--adapter` a PEFT adapter that loads onto the base, both with the trainer's logits."""
    import peft
    import transformers
    from cli_runner import crucible

    from crucible.clients.checkpoints import get_manifest, load_weights
    from crucible.model import PRESETS, Transformer
    from crucible.model.lora import attach, is_adapter, spec_of

    run_id = f"run-{uuid.uuid4().hex[:12]}"
    config = RunConfig.model_validate(
        {
            "model": {"source": "tiny-dense", "lora": {"rank": 4, "alpha": 8}},
            "optim": {"kl_coef": 0.1, "learning_rate": 1e-2},  # KL: the reference is version 0, merged
            "schedule": {"group_size": 2, "groups_per_step": 1, "max_steps": 1},
        }
    )
    settings = common_settings(TrainerSettings, ack_wait_s=30, heartbeat_s=5)
    async with (
        running("checkpoints", common_settings(CheckpointsSettings), checkpoints_setup),
        running("trainer", settings, trainer_setup) as rt,
    ):
        bus: Bus = rt.bus
        await one_step_run(bus, run_id, config, "lora")
        finished = await _finished(bus, run_id)
        assert finished.status == "finished", finished
        full, delta = [await get_manifest(bus=bus, run_id=run_id, version=v) for v in (0, 1)]
        _, start = await load_weights(bus=bus, store=rt.store, run_id=run_id, version=0)
        _, state = await load_weights(bus=bus, store=rt.store, run_id=run_id, version=1)
        env = {f"CRUCIBLE_{k.upper()}": str(v) for k, v in settings.model_dump().items() if v is not None}
        for args, out in (([], tmp_path / "merged"), (["--adapter"], tmp_path / "adapter")):
            done = await asyncio.to_thread(
                crucible, "model", "export", "--run", run_id, "--out", str(out), *args, env=env
            )
            assert done.returncode == 0, done.stderr
    assert (full.kind, delta.kind, delta.base_version) == ("full", "delta", 0)
    adapter_bytes = sum(t.numel() * t.element_size() for k, t in state.items() if is_adapter(k))
    assert sum(s.size for s in delta.shards) <= adapter_bytes + 0.01 * delta.raw_bytes
    assert all(torch.equal(state[k], start[k]) for k in state if not is_adapter(k))  # the base is frozen
    assert any(not torch.equal(state[k], start[k]) for k in state if is_adapter(k))

    cfg = PRESETS["tiny-dense"]
    lora = spec_of(state)
    assert lora is not None and lora.rank == 4 and lora.scale == 2.0
    model = Transformer(cfg, precision="fp32")
    attach(model, lora)
    model.load_state_dict(state)
    base = tmp_path / "base"
    export_weights({k: v for k, v in state.items() if not is_adapter(k)}, cfg, base)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base_model, tmp_path / "adapter")
    x = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.eval()(x).logits
        # fp32 throughout: the same function reassociated, a few ulps per product (see test_lora)
        assert (merged.eval()(x).logits - expected).abs().max() <= 1e-4
        assert (adapted.eval()(x).logits - expected).abs().max() <= 1e-4


async def _finished(bus: Bus, run_id: str, *, timeout_s: float = 60) -> RunFinished:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # the run's durable end, observed
        finished = await bus.latest(subjects.RUNS, subjects.run_finished(run_id), RunFinished)
        if finished is not None:
            return finished
        await asyncio.sleep(0.1)
    pytest.fail(f"run {run_id} did not finish")


async def test_a_step_with_a_non_finite_reward_is_skipped_and_too_many_fail_the_run(common_settings) -> None:
    """One bad group costs one skipped step (its groups asked for again) and the run trains on; as many
    bad steps in a row as the limit fail the run with the reason. A torn trainer state is survived."""
    from crucible.contracts.keys import trainer_state_key
    from services.trainer.job import RunFailed, RunJob

    config = RunConfig.model_validate(
        {"schedule": {"group_size": 2, "groups_per_step": 1, "max_steps": 1, "publish_every": 1}}
    )
    trainer = common_settings(TrainerSettings, ack_wait_s=30, heartbeat_s=5, max_nonfinite_steps=2)
    recovers, fails = f"run-{uuid.uuid4().hex[:12]}", f"run-{uuid.uuid4().hex[:12]}"
    nan = float("nan")
    async with (
        running("checkpoints", common_settings(CheckpointsSettings), checkpoints_setup),
        running("trainer", trainer, trainer_setup) as rt,
    ):
        bus: Bus = rt.bus
        for run_id, groups in (
            (recovers, [("bad", nan), ("good", 1.0)]),
            (fails, [("also-bad", nan), ("worse", nan)]),
        ):
            created = RunCreated(run_id=run_id, name="nan", config=config, created_at=time.time())
            await bus.publish(subjects.run_created(run_id), created, msg_id=run_id)
            for group, reward in groups:
                for index, member_reward in enumerate((reward, 0.0)):  # (message ids are the stream's)
                    message = graded(run_id, group, index, member_reward, "grep")
                    await bus.publish(
                        subjects.graded(run_id), message, msg_id=message.trajectory.trajectory_id
                    )
        recovered, failed = await _finished(bus, recovers), await _finished(bus, fails)
        step = (await bus.latest(subjects.EVENTS, subjects.events(recovers, "step"), Event)).data
        # the trainer's state: the newest of two slots that reads whole. Step 1's save is the run's first
        # (step 0's state is version 0) and went to slot 0; slot 1 now holds a save torn mid-write.
        store = rt.store
        await store.put_bytes(trainer_state_key(recovers, 1), b"torn")
        job = RunJob(rt=rt, created=RunCreated(run_id=recovers, name="nan", config=config, created_at=0.0))
        policy = await job.start_group()
        try:
            books = await job.resume()  # the whole slot, its ranks' files verified and loaded
        finally:
            policy.close()
        assert books is not None and (books.step, books.version) == (1, 1)
        kept = (
            rt.store
        )  # an S3 outage is not a torn state: never the older slot, since the newest may be there
        rt.store = ObjectStore.from_settings(rt.settings.model_copy(update={"s3_endpoint": "127.0.0.1:9"}))
        try:
            with pytest.raises(Unavailable):
                await RunJob(
                    rt=rt, created=RunCreated(run_id=recovers, name="nan", config=config, created_at=0.0)
                ).resume()
        finally:
            rt.store = kept
        await store.put_bytes(trainer_state_key(recovers, 0), b"torn too")
        with pytest.raises(RunFailed, match="reads whole"):
            await RunJob(
                rt=rt, created=RunCreated(run_id=recovers, name="nan", config=config, created_at=0.0)
            ).resume()
    assert recovered.status == "finished" and recovered.step == 1
    assert isinstance(step, StepReport) and sorted(step.trajectory_ids) == ["good-0", "good-1"]
    assert step.metrics["skipped_steps"] == 1.0
    assert failed.status == "failed" and "non-finite rewards" in failed.error and failed.step == 0


async def test_a_run_to_which_no_graded_work_comes_fails_saying_so(common_settings) -> None:
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    trainer = common_settings(TrainerSettings, ack_wait_s=30, heartbeat_s=5, stall_timeout_s=2)
    async with (
        running("checkpoints", common_settings(CheckpointsSettings), checkpoints_setup),
        running("trainer", trainer, trainer_setup) as rt,
    ):
        created = RunCreated(run_id=run_id, name="alone", config=RunConfig(), created_at=time.time())
        await rt.bus.publish(subjects.run_created(run_id), created, msg_id=run_id)
        ended = await _finished(rt.bus, run_id)  # nothing ever rolls it out
    assert ended.status == "failed" and "cannot progress" in ended.error and ended.version == 0


async def test_a_lora_run_whose_targets_the_model_lacks_fails_saying_so(common_settings) -> None:
    """The tiny preset's feed-forwards are all routed experts: gate_proj alone adapts nothing. The run
    fails once with the reason instead of its trainer retrying it."""
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    config = RunConfig.model_validate({"model": {"lora": {"targets": ["gate_proj"]}}})
    async with (
        running("checkpoints", common_settings(CheckpointsSettings), checkpoints_setup),
        running("trainer", common_settings(TrainerSettings), trainer_setup) as rt,
    ):
        created = RunCreated(run_id=run_id, name="lora", config=config, created_at=time.time())
        await rt.bus.publish(subjects.run_created(run_id), created, msg_id=run_id)
        ended = await _finished(rt.bus, run_id)
    assert ended.status == "failed" and "match no projection" in ended.error and "q_proj" in ended.error


async def test_runs_train_side_by_side_so_one_that_waits_blocks_no_other(common_settings) -> None:
    waiting, training = f"run-{uuid.uuid4().hex[:12]}", f"run-{uuid.uuid4().hex[:12]}"
    config = RunConfig.model_validate(
        {"schedule": {"group_size": 2, "groups_per_step": 1, "max_steps": 1, "publish_every": 1}}
    )
    trainer = common_settings(TrainerSettings, ack_wait_s=30, heartbeat_s=5, max_runs=2)
    async with (
        running("checkpoints", common_settings(CheckpointsSettings), checkpoints_setup),
        running("trainer", trainer, trainer_setup) as rt,
    ):
        bus: Bus = rt.bus
        for run_id in (waiting, training):  # the first is never rolled out
            created = RunCreated(run_id=run_id, name="side", config=config, created_at=time.time())
            await bus.publish(subjects.run_created(run_id), created, msg_id=run_id)
        for index, reward in enumerate((0.0, 1.0)):
            message = graded(training, f"{training}-g", index, reward, "grep")
            await bus.publish(subjects.graded(training), message, msg_id=message.trajectory.trajectory_id)
        ended = await _finished(bus, training)
        assert await bus.latest(subjects.RUNS, subjects.run_finished(waiting), RunFinished) is None
    assert ended.status == "finished" and ended.step == 1


async def test_an_attempt_that_ended_before_its_first_save_resumes_from_the_version_0_it_published(
    common_settings, tmp_path
) -> None:
    """Step 0's state is not saved: it is version 0, published before any step. The run's next attempt
    starts from that version rather than making version 0 again. Here the second attempt's config has
    another seed: made afresh, its version 0 would differ, and the checkpoints service would refuse it."""
    from services.trainer.job import RunJob
    from services.trainer.state import StateStore

    run_id = f"run-{uuid.uuid4().hex[:12]}"
    trainer = common_settings(TrainerSettings, ack_wait_s=30, heartbeat_s=5)
    async with (
        running("checkpoints", common_settings(CheckpointsSettings), checkpoints_setup),
        running("trainer", trainer, trainer_setup) as rt,
    ):
        weights = []
        for seed in (1, 2):
            config = RunConfig.model_validate({"seed": seed, "model": {"source": "tiny-dense"}})
            job = RunJob(rt=rt, created=RunCreated(run_id=run_id, name="v0", config=config, created_at=0.0))
            try:
                await job._start()
                assert job.policy is not None
                weights.append(await asyncio.to_thread(job.policy.weights))
            finally:
                await job._let_go()
                if job.policy is not None:
                    job.policy.close()
        states = StateStore(store=rt.store, run_id=run_id, work_dir=tmp_path, world_size=1)
        assert await states.resume(lambda directory: None) is None  # nothing was saved
    first, second = weights
    assert first is not None and second is not None and first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
