"""The checkpoints service and its client against real NATS and S3."""

from __future__ import annotations

import uuid

import msgspec
import pytest
import torch

from crucible.bus import RemoteError
from crucible.clients.checkpoints import WeightsError, get_manifest, load_weights, publish_weights
from crucible.contracts import decode, endpoints, subjects
from crucible.contracts.events import CheckpointPublished, Event
from crucible.contracts.keys import manifest_key, shard_key
from crucible.contracts.messages import (
    CommitReply,
    CommitRequest,
    TensorEntry,
    WeightsAnnounced,
    WeightsManifest,
)

pytestmark = pytest.mark.integration


def unique_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "layers.0.attn.wq": torch.randn(8, 8, generator=g),
        "layers.0.moe.w1_EFD": torch.randn(2, 4, 8, generator=g).to(torch.bfloat16),
        "step_counter": torch.tensor([7], dtype=torch.int64),
    }


async def announcements(bus, run_id: str) -> int:
    info = await bus.js.stream_info(subjects.WEIGHTS, subjects_filter=subjects.weights_announced(run_id))
    return (info.state.subjects or {}).get(subjects.weights_announced(run_id), 0)


async def commit(bus, manifest: WeightsManifest) -> CommitReply:
    return await bus.request(endpoints.CHECKPOINTS_COMMIT, CommitRequest(manifest=manifest), timeout=30)


async def test_commit_stores_manifest_and_announces(bus, store):
    run_id = unique_name("run")
    manifest = await publish_weights(
        bus=bus, store=store, run_id=run_id, version=0, step=0, state_dict=state_dict(), shard_bytes=300
    )
    assert len(manifest.shards) > 1
    assert await store.exists(manifest_key(run_id, 0))

    announced = await bus.latest(subjects.WEIGHTS, subjects.weights_announced(run_id), WeightsAnnounced)
    assert (announced.version, announced.step) == (0, 0)
    assert decode(await store.get_bytes(announced.manifest), WeightsManifest) == manifest

    event = await bus.latest(subjects.EVENTS, subjects.events(run_id, "checkpoint"), Event)
    assert event.kind == "checkpoint" and event.msg_id == f"{run_id}/checkpoint/0"
    assert event.data == CheckpointPublished(
        version=0,
        step=0,
        manifest_uri=announced.manifest.uri,
        num_tensors=4,
        size_bytes=sum(s.size for s in manifest.shards),
        weights="full",
        raw_bytes=manifest.raw_bytes,
    )
    assert manifest.raw_bytes == sum(t.numel() * t.element_size() for t in state_dict().values())

    await publish_weights(bus=bus, store=store, run_id=run_id, version=1, step=2, state_dict=state_dict(1))
    assert (await get_manifest(bus=bus, run_id=run_id)).version == 1
    assert (await get_manifest(bus=bus, run_id=run_id, version=0)) == manifest
    for version in (2, -1):
        with pytest.raises(RemoteError) as err:
            await get_manifest(bus=bus, run_id=run_id, version=version)
        assert err.value.code == "not_found"
    with pytest.raises(RemoteError) as err:
        await get_manifest(bus=bus, run_id=unique_name("nobody"))
    assert err.value.code == "not_found"


async def test_recommit_is_idempotent_and_versions_only_go_forward(bus, store):
    run_id = unique_name("run")
    manifest = await publish_weights(
        bus=bus, store=store, run_id=run_id, version=3, step=6, state_dict=state_dict()
    )
    first = await bus.latest(subjects.WEIGHTS, subjects.weights_announced(run_id), WeightsAnnounced)

    retried = msgspec.structs.replace(manifest, created_at=manifest.created_at + 5)
    reply = await commit(bus, retried)
    assert reply.manifest == first.manifest
    assert await announcements(bus, run_id) == 1

    with pytest.raises(RemoteError) as err:
        await commit(bus, msgspec.structs.replace(manifest, step=7))
    assert err.value.code == "bad_version"

    again = await publish_weights(
        bus=bus, store=store, run_id=run_id, version=3, step=6, state_dict=state_dict()
    )
    assert again.shards == manifest.shards
    with pytest.raises(WeightsError, match="already committed"):
        await publish_weights(
            bus=bus, store=store, run_id=run_id, version=3, step=6, state_dict=state_dict(9)
        )
    _, loaded = await load_weights(bus=bus, store=store, run_id=run_id, version=3)
    assert torch.equal(loaded["layers.0.attn.wq"], state_dict()["layers.0.attn.wq"])
    with pytest.raises(RemoteError) as err:
        await publish_weights(bus=bus, store=store, run_id=run_id, version=2, step=7, state_dict=state_dict())
    assert err.value.code == "bad_version"
    assert await announcements(bus, run_id) == 1


async def test_commit_refuses_tampered_missing_and_malformed_shards(bus, store):
    run_id = unique_name("run")
    sd = state_dict()
    manifest = await publish_weights(bus=bus, store=store, run_id=run_id, version=0, step=0, state_dict=sd)
    shard = manifest.shards[0]

    tampered = bytearray(await store.get_bytes(shard))
    tampered[-1] ^= 0xFF
    ref = await store.put_bytes(shard_key(run_id, 1, 0), bytes(tampered))
    lying = msgspec.structs.replace(ref, sha256=shard.sha256, size=shard.size)
    cases = {
        "integrity": msgspec.structs.replace(manifest, version=1, shards=[lying]),
        "missing_shard": msgspec.structs.replace(
            manifest,
            version=2,
            shards=[msgspec.structs.replace(shard, uri=store.uri(shard_key(run_id, 2, 0)))],
        ),
        "bad_shard": msgspec.structs.replace(manifest, version=1),  # shard of version 0 under version 1
        "bad_tensor": msgspec.structs.replace(
            manifest,
            version=1,
            shards=[ref],
            tensors=[*manifest.tensors, TensorEntry(name="x", shape=[1], dtype="float32", shard=3)],
        ),
    }
    for code, bad in cases.items():
        with pytest.raises(RemoteError) as err:
            await commit(bus, bad)
        assert err.value.code == code, err.value
    assert (await get_manifest(bus=bus, run_id=run_id)).version == 0
    assert not await store.exists(manifest_key(run_id, 1))


async def test_load_weights_round_trips_and_detects_corruption(bus, store):
    run_id = unique_name("run")
    sd = state_dict(3)
    await publish_weights(
        bus=bus, store=store, run_id=run_id, version=5, step=10, state_dict=sd, shard_bytes=300
    )

    manifest, loaded = await load_weights(bus=bus, store=store, run_id=run_id)
    assert manifest.version == 5
    assert loaded.keys() == sd.keys()
    for name, tensor in sd.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor)

    shard = manifest.shards[-1]
    data = bytearray(await store.get_bytes(shard))
    data[-1] ^= 0x01
    await store.put_bytes(shard_key(run_id, 5, len(manifest.shards) - 1), bytes(data))
    with pytest.raises(WeightsError, match="corrupt"):
        await load_weights(bus=bus, store=store, run_id=run_id, version=5)


async def test_load_weights_checks_tensors_against_the_manifest(bus, store):
    """A manifest whose shards verify but whose tensor list lies is caught when loading."""
    run_id = unique_name("run")
    manifest = await publish_weights(
        bus=bus, store=store, run_id=run_id, version=0, step=0, state_dict=state_dict()
    )
    entries = list(manifest.tensors)
    entries[0] = msgspec.structs.replace(entries[0], shape=[8, 16])
    await commit(
        bus,
        msgspec.structs.replace(
            manifest,
            version=1,
            shards=[
                await store.put_bytes(shard_key(run_id, 1, 0), await store.get_bytes(manifest.shards[0]))
            ],
            tensors=entries,
        ),
    )
    with pytest.raises(WeightsError, match="manifest says"):
        await load_weights(bus=bus, store=store, run_id=run_id)


@pytest.mark.parametrize("checkpoints_settings", [{"keep_last_versions": 2, "full_every": 2}], indirect=True)
async def test_retention_keeps_newest_and_full_snapshots(bus, store):
    run_id = unique_name("run")
    for version in range(5):
        await publish_weights(
            bus=bus, store=store, run_id=run_id, version=version, step=version, state_dict=state_dict()
        )
    kept = {v for v in range(5) if await store.exists(manifest_key(run_id, v))}
    assert kept == {0, 2, 3, 4}
    assert not await store.exists(shard_key(run_id, 1, 0))
    with pytest.raises(RemoteError) as err:
        await get_manifest(bus=bus, run_id=run_id, version=1)
    assert err.value.code == "not_found"
