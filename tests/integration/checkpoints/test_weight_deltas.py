"""Delta versions against real NATS and S3: exact round trips, refused corruption, late replicas catching
up from the last full snapshot, retention keeping the bases of kept deltas."""

from __future__ import annotations

import uuid

import msgspec
import pytest
import torch

from crucible.bus import RemoteError
from crucible.clients.checkpoints import (
    WeightsError,
    WeightsFollower,
    WeightsPublisher,
    get_manifest,
    load_weights,
)
from crucible.contracts import endpoints, subjects
from crucible.contracts.keys import delta_shard_key, manifest_key
from crucible.contracts.messages import CommitReply, CommitRequest, WeightsAnnounced, WeightsManifest
from crucible.model.weight_delta import encode_delta, tensor_sha256

pytestmark = pytest.mark.integration


def unique_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def weights(version: int) -> dict[str, torch.Tensor]:
    """bf16 weights in which each version changes a few elements, as a small RL step does, plus an
    fp32 tensor and an integer one."""
    g = torch.Generator().manual_seed(0)
    state = {
        "embed.weight": torch.randn(512, 64, generator=g).to(torch.bfloat16),
        "layers.0.attn.wq": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "layers.0.norm": torch.ones(64),
        "step_counter": torch.tensor([0], dtype=torch.int64),
    }
    for v in range(1, version + 1):
        g = torch.Generator().manual_seed(v)
        for name in ("embed.weight", "layers.0.attn.wq"):
            flat = state[name].view(-1)
            flat[torch.randint(0, flat.numel(), (20,), generator=g)] += 0.25
        state["layers.0.norm"] += 1e-3
        state["step_counter"] += 1
    return state


def assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert tensor_sha256(got[name]) == tensor_sha256(tensor), name


async def commit(bus, manifest: WeightsManifest) -> CommitReply:
    return await bus.request(endpoints.CHECKPOINTS_COMMIT, CommitRequest(manifest=manifest), timeout=30)


async def test_deltas_round_trip_exactly_and_republishing_is_idempotent(bus, store):
    run_id = unique_name("run")
    publisher = WeightsPublisher(bus=bus, store=store, run_id=run_id, full_every=4, shard_bytes=40_000)
    manifests = [await publisher.publish(version=v, step=2 * v, state_dict=weights(v)) for v in range(6)]
    assert [(m.kind, m.base_version) for m in manifests] == [
        ("full", None), ("delta", 0), ("delta", 0), ("delta", 0), ("full", None), ("delta", 4),
    ]  # fmt: skip
    full, delta = manifests[0], manifests[1]
    assert len(delta.shards) == len(full.shards) > 1
    assert full.raw_bytes == delta.raw_bytes == sum(t.numel() * t.element_size() for t in weights(0).values())
    assert sum(s.size for s in delta.shards) < 0.1 * sum(s.size for s in full.shards)
    for version in range(6):
        manifest, state = await load_weights(bus=bus, store=store, run_id=run_id, version=version)
        assert manifest == manifests[version]
        assert_exact(state, weights(version))

    # A restarted trainer re-publishes its last versions: same weights, same manifest, 5 stays the latest;
    # other weights for it are refused before anything is uploaded. Its next version is a full snapshot.
    restarted = WeightsPublisher(bus=bus, store=store, run_id=run_id, full_every=4)
    assert await restarted.publish(version=5, step=10, state_dict=weights(5)) == manifests[5]
    assert await restarted.publish(version=3, step=6, state_dict=weights(3)) == manifests[3]
    latest = await bus.latest(subjects.WEIGHTS, subjects.weights_announced(run_id), WeightsAnnounced)
    assert latest.version == 5
    with pytest.raises(WeightsError, match="already committed with other weights"):
        await restarted.publish(version=5, step=10, state_dict=weights(4))
    assert (await restarted.publish(version=6, step=12, state_dict=weights(6))).kind == "full"
    assert (await restarted.publish(version=7, step=14, state_dict=weights(7))).base_version == 6


async def test_a_corrupt_delta_is_refused_and_nothing_is_loaded(bus, store):
    run_id = unique_name("run")
    publisher = WeightsPublisher(bus=bus, store=store, run_id=run_id)
    await publisher.publish(version=0, step=0, state_dict=weights(0))
    good = await publisher.publish(version=1, step=1, state_dict=weights(1))
    follower = WeightsFollower(bus=bus, store=store, run_id=run_id)
    await follower.load(1)

    # A delta whose bytes are intact but rebuild other weights (here: made against the wrong base) is
    # committed (the service cannot tell), and refused by every loader on the tensors' sha256.
    names = [e.name for e in good.tensors]
    wrong = encode_delta([weights(1)[n] for n in names], [weights(2)[n] for n in names])
    ref = await store.put_bytes(delta_shard_key(run_id, 2, 0), wrong)
    await commit(bus, msgspec.structs.replace(good, version=2, step=2, shards=[ref]))
    with pytest.raises(WeightsError, match=r"rebuilt from base version 0 has sha256 .* nothing is loaded"):
        await follower.load(2)
    assert follower.base is not None and follower.base.version == 0
    _, state = await follower.load(1)  # the base it keeps was not touched
    assert_exact(state, weights(1))

    # A delta shard altered in the object store after its commit fails its shard sha256.
    data = bytearray(await store.get_bytes(good.shards[0]))
    data[len(data) // 2] ^= 0x01
    await store.put_bytes(delta_shard_key(run_id, 1, 0), bytes(data))
    with pytest.raises(WeightsError, match="shard 0 is corrupt"):
        await load_weights(bus=bus, store=store, run_id=run_id, version=1)


async def test_the_service_refuses_deltas_without_a_full_base(bus, store):
    run_id = unique_name("run")
    publisher = WeightsPublisher(bus=bus, store=store, run_id=run_id)
    await publisher.publish(version=0, step=0, state_dict=weights(0))
    delta = await publisher.publish(version=1, step=1, state_dict=weights(1))
    ref = await store.put_bytes(delta_shard_key(run_id, 2, 0), await store.get_bytes(delta.shards[0]))
    cases = {
        "bad_base": [
            msgspec.structs.replace(delta, version=2, shards=[ref], base_version=1),  # a delta as base
            msgspec.structs.replace(delta, version=2, shards=[ref], base_version=None),
            msgspec.structs.replace(delta, version=2, shards=[ref], kind="full", base_version=0),
            msgspec.structs.replace(  # other tensors than the base
                delta, version=2, shards=[ref], tensors=[msgspec.structs.replace(delta.tensors[0], shape=[1])]
            ),
        ],
        "bad_tensor": [
            msgspec.structs.replace(
                delta,
                version=2,
                shards=[ref],
                tensors=[msgspec.structs.replace(e, sha256="") for e in delta.tensors],
            ),
        ],
    }
    for code, manifests in cases.items():
        for manifest in manifests:
            with pytest.raises(RemoteError) as err:
                await commit(bus, manifest)
            assert err.value.code == code, err.value
    assert (await get_manifest(bus=bus, run_id=run_id)).version == 1


async def test_a_late_replica_catches_up_from_the_last_full_snapshot(bus, store):
    run_id = unique_name("run")
    publisher = WeightsPublisher(bus=bus, store=store, run_id=run_id, full_every=3)
    follower = WeightsFollower(bus=bus, store=store, run_id=run_id)
    await publisher.publish(version=0, step=0, state_dict=weights(0))
    await publisher.publish(version=1, step=1, state_dict=weights(1))
    _, state = await follower.load()
    assert_exact(state, weights(1))
    for version in range(2, 6):  # the follower misses 2..4, and the full snapshot 3 with them
        await publisher.publish(version=version, step=version, state_dict=weights(version))

    manifest, state = await follower.load()
    assert (manifest.version, manifest.kind, manifest.base_version) == (5, "delta", 3)
    assert follower.base is not None and follower.base.version == 3
    assert_exact(state, weights(5))
    late = WeightsFollower(bus=bus, store=store, run_id=run_id)  # a replica started just now
    _, state = await late.load(4)
    assert_exact(state, weights(4))


@pytest.mark.parametrize("checkpoints_settings", [{"keep_last_versions": 2, "full_every": 0}], indirect=True)
async def test_retention_keeps_the_base_of_every_kept_delta(bus, store):
    run_id = unique_name("run")
    publisher = WeightsPublisher(bus=bus, store=store, run_id=run_id, full_every=4)

    async def kept() -> set[int]:
        return {v for v in range(8) if await store.exists(manifest_key(run_id, v))}

    for version in range(4):
        await publisher.publish(version=version, step=version, state_dict=weights(version))
    assert await kept() == {0, 2, 3}  # 0 is old, but the base of the kept deltas 2 and 3
    for version in range(4, 7):
        await publisher.publish(version=version, step=version, state_dict=weights(version))
    assert await kept() == {4, 5, 6}
    _, state = await load_weights(bus=bus, store=store, run_id=run_id, version=5)
    assert_exact(state, weights(5))
    latest = await bus.latest(subjects.WEIGHTS, subjects.weights_announced(run_id), WeightsAnnounced)
    assert latest.version == 6
