"""A rollout replica refreshing its weights from delta versions, against the real checkpoints service,
NATS and S3, with the real in-process engine (the byte-level preset): each version swapped in is exactly
the published one, and a delta that does not reproduce its tensors swaps nothing in."""

from __future__ import annotations

import uuid

import msgspec
import pytest
import torch

from crucible.clients.checkpoints import WeightsPublisher
from crucible.contracts import endpoints
from crucible.contracts.keys import delta_shard_key
from crucible.contracts.messages import CommitRequest
from crucible.contracts.runconfig import RunConfig
from crucible.model import PRESETS, build_model
from crucible.model.weight_delta import encode_delta
from crucible.runtime import running
from services.checkpoints.app import setup as checkpoints_setup
from services.checkpoints.settings import Settings as CheckpointsSettings
from services.rollout.settings import Settings as RolloutSettings
from services.rollout.slots import EpisodeSlots
from services.rollout.worker import RunWorker

pytestmark = pytest.mark.integration


async def no_setup(rt) -> None:
    """The replica's runtime (bus, store, Redis) without its run-following handlers: the test drives it."""


def versions(config: RunConfig, count: int) -> list[dict[str, torch.Tensor]]:
    model = build_model(PRESETS[config.model.source], precision=config.model.precision, seed=config.seed)
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    out = [state]
    for v in range(1, count):
        g = torch.Generator().manual_seed(v)
        state = {k: t.clone() for k, t in state.items()}
        for t in state.values():
            flat = t.view(-1)
            flat[torch.randint(0, flat.numel(), (3,), generator=g)] += 0.5
        out.append(state)
    return out


def engine_weights(worker: RunWorker) -> dict[str, torch.Tensor]:
    return worker.engine.batcher.model.state_dict()


def same(engine: dict[str, torch.Tensor], published: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(engine[k], t.to(engine[k].dtype)) for k, t in published.items())


async def test_a_replica_swaps_in_deltas_exactly_and_refuses_a_corrupt_one(common_settings):
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    config = RunConfig.model_validate({})
    weights = versions(config, 3)
    rollout_settings = common_settings(RolloutSettings, max_context=256, max_episodes=3)
    async with (
        running("checkpoints", common_settings(CheckpointsSettings), checkpoints_setup),
        running("rollout", rollout_settings, no_setup) as rt,
    ):
        worker = RunWorker(rt=rt, run_id=run_id, config=config, episodes=None, slots=EpisodeSlots(1))
        assert worker.engine.batcher.max_slots == 3  # the KV cache never outgrows the replica's episodes
        try:
            publisher = WeightsPublisher(bus=rt.bus, store=rt.store, run_id=run_id)
            for version in (0, 1):
                manifest = await publisher.publish(version=version, step=version, state_dict=weights[version])
                worker.latest_announced = version
                await worker._load(version)
                assert worker.engine.version == version and same(engine_weights(worker), weights[version])
            assert manifest.kind == "delta" and worker.weights.base.version == 0

            # Version 2 is committed with intact shards that rebuild other weights than its manifest's.
            names = [e.name for e in manifest.tensors]
            wrong = encode_delta([weights[2][n] for n in names], [weights[1][n] for n in names])
            assert len(manifest.shards) == 1  # the preset is small
            refs = [await rt.store.put_bytes(delta_shard_key(run_id, 2, 0), wrong)]
            bad = msgspec.structs.replace(manifest, version=2, step=2, shards=refs)
            await rt.bus.request(endpoints.CHECKPOINTS_COMMIT, CommitRequest(manifest=bad), timeout=30)
            worker.latest_announced = 2
            await worker._load(2)
            assert worker.engine.version == 1 and same(engine_weights(worker), weights[1])
        finally:
            await worker.engine.aclose()
