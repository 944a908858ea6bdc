"""Client side of the checkpoints service: the trainer publishes weights, rollouts load them.

Weights are a manifest (every tensor's name, shape, dtype and shard) plus safetensors shards in the
object store under `runs/<run>/weights/<version:06d>/` (see crucible.contracts.keys). The trainer
uploads the shards itself and asks the service to commit them; the service verifies and announces. A loader checks every shard's sha256
(the object store does) and every tensor against the manifest, so a rollout never runs weights other
than the ones announced. torch is imported inside the functions that need it.
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING

from crucible.bus import Bus, RemoteError
from crucible.contracts import subjects
from crucible.contracts.keys import shard_key
from crucible.contracts.messages import (
    CheckpointReply,
    CheckpointRequest,
    CommitReply,
    CommitRequest,
    ObjectRef,
    TensorEntry,
    WeightsManifest,
)
from crucible.model.shards import DEFAULT_SHARD_BYTES, plan_shards
from crucible.objectstore import IntegrityError

if TYPE_CHECKING:
    import torch

    from crucible.objectstore import ObjectStore


class WeightsError(RuntimeError):
    """Weights do not match their manifest (corrupt shard, missing or reshaped tensor), or a version
    is published again with other weights than the ones committed."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


async def publish_weights(
    *,
    bus: Bus,
    store: ObjectStore,
    run_id: str,
    version: int,
    step: int,
    state_dict: dict[str, torch.Tensor],
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    timeout: float = 120.0,
) -> WeightsManifest:
    """Upload `state_dict` as safetensors shards and commit it as `version`.

    Safe to retry: shards serialize to the same bytes every time, and a version that is already
    committed is never overwritten (different weights for it raise WeightsError before any upload).
    Weights with a non-finite value are refused (WeightsError) before anything is uploaded.
    """
    import torch
    from safetensors.torch import save

    if not state_dict:
        raise ValueError("state_dict is empty")
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state_dict.items()}
    if bad := [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]:
        raise WeightsError(f"run {run_id} version {version}: {bad[:8]} hold non-finite values; nothing is published")
    committed = await _committed(bus=bus, run_id=run_id, version=version)
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    entries: list[TensorEntry] = []
    shards: list[ObjectRef] = []
    for index, names in enumerate(plan_shards(sizes=sizes, shard_bytes=shard_bytes)):
        # One metadata key: safetensors writes a multi-key metadata map in no fixed order, and retries
        # rely on a shard serializing to the same bytes every time.
        data = save({name: tensors[name] for name in names}, metadata={"crucible": f"{run_id}/weights/{version}"})
        if committed is None:
            shards.append(await store.put_bytes(shard_key(run_id, version, index), data))
        elif index < len(committed.shards) and _matches(committed.shards[index], data):
            shards.append(committed.shards[index])
        else:
            raise WeightsError(f"run {run_id} version {version} is already committed with other weights")
        entries += [
            TensorEntry(name=n, shape=list(tensors[n].shape), dtype=dtype_name(tensors[n].dtype), shard=index)
            for n in names
        ]
    manifest = WeightsManifest(
        run_id=run_id, version=version, step=step, created_at=time.time(), tensors=entries, shards=shards
    )
    await bus.request(
        subjects.CHECKPOINTS_COMMIT, CommitRequest(manifest=manifest), CommitReply, timeout=timeout
    )
    return manifest


async def _committed(*, bus: Bus, run_id: str, version: int) -> WeightsManifest | None:
    try:
        return await get_manifest(bus=bus, run_id=run_id, version=version)
    except RemoteError as exc:
        if exc.code == "not_found":
            return None
        raise


def _matches(ref: ObjectRef, data: bytes) -> bool:
    return ref.size == len(data) and ref.sha256 == hashlib.sha256(data).hexdigest()


async def get_manifest(
    *, bus: Bus, run_id: str, version: int | None = None, timeout: float = 10.0
) -> WeightsManifest:
    """The manifest of `version`, or of the latest announced version when None."""
    request = CheckpointRequest(run_id=run_id, version=version)
    reply = await bus.request(subjects.CHECKPOINTS_GET, request, CheckpointReply, timeout=timeout)
    return reply.manifest


async def load_shards(*, store: ObjectStore, manifest: WeightsManifest) -> dict[str, torch.Tensor]:
    """Download and verify every shard of `manifest`; raise WeightsError on any mismatch."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    where = f"run {manifest.run_id} version {manifest.version}"
    state: dict[str, torch.Tensor] = {}
    for index, ref in enumerate(manifest.shards):
        try:
            loaded = load(await store.get_bytes(ref))
        except IntegrityError as exc:
            raise WeightsError(f"{where}: shard {index} is corrupt: {exc}") from exc
        except SafetensorError as exc:
            raise WeightsError(f"{where}: shard {index} is not a safetensors file: {exc}") from exc
        expected = {e.name: e for e in manifest.tensors if e.shard == index}
        if missing := sorted(expected.keys() - loaded.keys()):
            raise WeightsError(f"{where}: shard {index} lacks tensors {missing}")
        if extra := sorted(loaded.keys() - expected.keys()):
            raise WeightsError(f"{where}: shard {index} has tensors not in the manifest: {extra}")
        for name, tensor in loaded.items():
            entry = expected[name]
            if list(tensor.shape) != entry.shape or dtype_name(tensor.dtype) != entry.dtype:
                raise WeightsError(
                    f"{where}: tensor {name} is {dtype_name(tensor.dtype)}{list(tensor.shape)}, "
                    f"manifest says {entry.dtype}{entry.shape}"
                )
        state.update(loaded)
    return state


async def load_weights(
    *, bus: Bus, store: ObjectStore, run_id: str, version: int | None = None
) -> tuple[WeightsManifest, dict[str, torch.Tensor]]:
    """Fetch a version's manifest (the latest when None) and its verified tensors."""
    manifest = await get_manifest(bus=bus, run_id=run_id, version=version)
    return manifest, await load_shards(store=store, manifest=manifest)
