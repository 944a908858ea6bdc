"""Client side of the checkpoints service: the trainer publishes weights, rollouts load them.

Weights are a manifest (every tensor's name, shape, dtype, sha256 and shard) plus shards in the object
store under `runs/<run>/weights/<version:06d>/` (see crucible.contracts.keys). The trainer uploads the
shards itself and asks the service to commit them; the service verifies and announces. A loader checks
every shard's sha256 and every tensor against the manifest, down to the sha256 of its bytes, so a rollout
never runs weights other than the ones announced. torch is imported inside the functions that need it.

A version is `full` (safetensors shards) or a `delta` (crucible.model.weight_delta: per shard, the
zstd-compressed XOR of its tensors with the same tensors of a full version). A delta's base is the last
full snapshot, not the previous version: a replica that missed any number of versions catches up with
two downloads (the base, then the delta) instead of a chain, a lost or corrupt delta spoils only its own
version, and retention keeps one base per kept delta. The price is that the delta at k versions past
the base holds every bit that changed in those k versions; with a full snapshot every `full_every`
versions (10 by default) that stays a few percent of the weights for bf16 at RL learning rates
(docs/benchmarks.md, bench_weight_delta), and a replica that follows every version keeps the base in
memory, so each refresh downloads just one delta.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from crucible.bus import Bus, RemoteError
from crucible.contracts import endpoints
from crucible.contracts.keys import delta_shard_key, shard_key
from crucible.contracts.messages import (
    CheckpointRequest,
    CommitRequest,
    ObjectRef,
    TensorEntry,
    WeightsManifest,
)
from crucible.model.shards import plan_shards
from crucible.objectstore import ObjectNotFound

if TYPE_CHECKING:
    import torch

    from crucible.objectstore import ObjectStore

DEFAULT_FULL_EVERY = 10
"""Versions that are a multiple of this are full snapshots; those between are deltas against the last."""
CONCURRENCY = 8
"""Shards uploaded or downloaded at once."""
PUBLISH_SHARD_BYTES = 64 * 1024 * 1024
"""Shards of published versions: a replica fetches, decompresses and verifies shards in parallel, so
smaller shards than a local checkpoint's keep every core busy (SmolLM2-135M refreshes from a delta in
0.31 s with 64 MiB shards, 0.42 s with 256 MiB ones on 2 cores)."""
T = TypeVar("T")


class WeightsError(RuntimeError):
    """Weights do not match their manifest (corrupt shard or delta, missing or reshaped tensor, a tensor
    whose sha256 is not the published one), or a version is published again with other weights than the
    ones committed."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Snapshot:
    """A full version's tensors, kept in memory to diff against (trainer) or to apply deltas to (rollout)."""

    version: int
    tensors: dict[str, torch.Tensor]


# --- publishing -------------------------------------------------------------------------------------


class WeightsPublisher:
    """Publishes a run's versions, each a delta against the last full snapshot it published, or a full
    snapshot when `version` is a multiple of `full_every` (1: every version is full).

    It keeps a private copy of the last full snapshot's tensors in CPU memory (one more copy of the
    weights). A new publisher, such as the trainer's after a restart, has no base: its first version is a
    full snapshot whatever its number, which costs one full upload and no download (fetching the old base
    would cost as much and add a way to fail). `dtype` casts floating-point tensors before publishing:
    bf16 weights diff to a few percent, fp32 master weights barely compress.

    Re-publishing a committed version (the trainer retrying after a crash) is a no-op if every tensor has
    the committed sha256, and WeightsError otherwise, before anything is uploaded.
    """

    def __init__(
        self,
        *,
        bus: Bus,
        store: ObjectStore,
        run_id: str,
        full_every: int = DEFAULT_FULL_EVERY,
        shard_bytes: int = PUBLISH_SHARD_BYTES,
        dtype: torch.dtype | None = None,
        timeout: float = 120.0,
    ) -> None:
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.bus, self.store, self.run_id = bus, store, run_id
        self.full_every, self.shard_bytes, self.dtype, self.timeout = full_every, shard_bytes, dtype, timeout
        self.base: Snapshot | None = None

    async def publish(
        self, *, version: int, step: int, state_dict: dict[str, torch.Tensor]
    ) -> WeightsManifest:
        """Upload `state_dict` as `version` (full or delta) and commit it; returns the committed manifest.

        Weights with a non-finite value are refused (WeightsError) before anything is uploaded."""
        tensors = await asyncio.to_thread(self._copy, state_dict, version)
        hashes = await asyncio.to_thread(lambda: {n: _sha256(t) for n, t in tensors.items()})
        committed = await _committed(bus=self.bus, run_id=self.run_id, version=version)
        if committed is not None:
            manifest = await self._recommit(committed, tensors, hashes)
        else:
            base = self.base if self._delta_from(version, tensors) else None
            manifest = await self._upload(
                version=version, step=step, tensors=tensors, hashes=hashes, base=base
            )
            await self._commit(manifest)
        if manifest.kind == "full":
            self.base = Snapshot(version=version, tensors=tensors)
        return manifest

    def _copy(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
        """Private CPU copies: the trainer goes on updating its parameters in place."""
        import torch

        if not state_dict:
            raise ValueError("state_dict is empty")
        tensors = {}
        for name, t in state_dict.items():
            dtype = self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype
            tensors[name] = t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
        bad = [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad:
            raise WeightsError(
                f"run {self.run_id} version {version}: {bad[:8]} hold non-finite values; nothing is published"
            )
        return tensors

    def _delta_from(self, version: int, tensors: dict[str, torch.Tensor]) -> bool:
        base = self.base
        if base is None or version % self.full_every == 0 or base.version >= version:
            return False
        return list(base.tensors) == list(tensors) and all(
            (b.shape, b.dtype) == (tensors[n].shape, tensors[n].dtype) for n, b in base.tensors.items()
        )

    async def _upload(
        self,
        *,
        version: int,
        step: int,
        tensors: dict[str, torch.Tensor],
        hashes: dict[str, str],
        base: Snapshot | None,
    ) -> WeightsManifest:
        from crucible.model.weight_delta import encode_delta

        sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
        plan = list(plan_shards(sizes=sizes, shard_bytes=self.shard_bytes))

        def encode(index: int) -> bytes:
            names = plan[index]
            if base is None:
                return _full_shard(tensors, names, self.run_id, version)
            return encode_delta([tensors[n] for n in names], [base.tensors[n] for n in names])

        key = shard_key if base is None else delta_shard_key

        async def upload(index: int) -> ObjectRef:
            data = await asyncio.to_thread(encode, index)
            return await self.store.put_bytes(key(self.run_id, version, index), data)

        shards = await _bounded([lambda i=i: upload(i) for i in range(len(plan))])
        entries = [
            TensorEntry(
                name=n, shape=list(tensors[n].shape), dtype=dtype_name(tensors[n].dtype), shard=index,
                sha256=hashes[n],
            )
            for index, names in enumerate(plan)
            for n in names
        ]  # fmt: skip
        return WeightsManifest(
            run_id=self.run_id, version=version, step=step, created_at=time.time(), tensors=entries,
            shards=shards, kind="full" if base is None else "delta",
            base_version=None if base is None else base.version, raw_bytes=sum(sizes.values()),
        )  # fmt: skip

    async def _recommit(
        self, committed: WeightsManifest, tensors: dict[str, torch.Tensor], hashes: dict[str, str]
    ) -> WeightsManifest:
        where = f"run {self.run_id} version {committed.version}"
        if all(e.sha256 for e in committed.tensors):
            same = {e.name: (e.shape, e.dtype, e.sha256) for e in committed.tensors} == {
                n: (list(t.shape), dtype_name(t.dtype), hashes[n]) for n, t in tensors.items()
            }
        else:  # committed before tensors had hashes: its safetensors shards are the same bytes or not
            names = [
                [e.name for e in committed.tensors if e.shard == i] for i in range(len(committed.shards))
            ]
            same = (
                all(names)
                and set().union(*map(set, names)) == set(tensors)
                and all(
                    _matches(ref, _full_shard(tensors, group, self.run_id, committed.version))
                    for ref, group in zip(committed.shards, names, strict=True)
                )
            )
        if not same:
            raise WeightsError(f"{where} is already committed with other weights")
        await self._commit(committed)  # announces it if the first attempt stopped short of that
        return committed

    async def _commit(self, manifest: WeightsManifest) -> None:
        request = CommitRequest(manifest=manifest)
        await self.bus.request(endpoints.CHECKPOINTS_COMMIT, request, timeout=self.timeout)


async def publish_weights(
    *,
    bus: Bus,
    store: ObjectStore,
    run_id: str,
    version: int,
    step: int,
    state_dict: dict[str, torch.Tensor],
    shard_bytes: int = PUBLISH_SHARD_BYTES,
    timeout: float = 120.0,
) -> WeightsManifest:
    """Publish `state_dict` as a full snapshot `version`, for a caller that keeps no publisher between
    versions (WeightsPublisher publishes deltas). Safe to retry, like WeightsPublisher.publish."""
    publisher = WeightsPublisher(
        bus=bus, store=store, run_id=run_id, full_every=1, shard_bytes=shard_bytes, timeout=timeout
    )
    return await publisher.publish(version=version, step=step, state_dict=state_dict)


def _full_shard(tensors: dict[str, torch.Tensor], names: list[str], run_id: str, version: int) -> bytes:
    from safetensors.torch import save

    # One metadata key: safetensors writes a multi-key metadata map in no fixed order, and retries rely
    # on a shard serializing to the same bytes every time.
    return save({n: tensors[n] for n in names}, metadata={"crucible": f"{run_id}/weights/{version}"})


def _sha256(tensor: torch.Tensor) -> str:
    from crucible.model.weight_delta import tensor_sha256

    return tensor_sha256(tensor)


async def _committed(*, bus: Bus, run_id: str, version: int) -> WeightsManifest | None:
    try:
        return await get_manifest(bus=bus, run_id=run_id, version=version)
    except RemoteError as exc:
        if exc.code == "not_found":
            return None
        raise


def _matches(ref: ObjectRef, data: bytes) -> bool:
    return ref.size == len(data) and ref.sha256 == hashlib.sha256(data).hexdigest()


async def _bounded(calls: list[Callable], limit: int = CONCURRENCY) -> list:
    """Run the coroutine factories with at most `limit` at once; results in order."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Callable):
        async with gate:
            return await call()

    return await asyncio.gather(*(one(c) for c in calls))


# --- loading ----------------------------------------------------------------------------------------


async def get_manifest(
    *, bus: Bus, run_id: str, version: int | None = None, timeout: float = 10.0
) -> WeightsManifest:
    """The manifest of `version`, or of the latest announced version when None."""
    request = CheckpointRequest(run_id=run_id, version=version)
    reply = await bus.request(endpoints.CHECKPOINTS_GET, request, timeout=timeout)
    return reply.manifest


async def _fetch_shards(
    *, store: ObjectStore, manifest: WeightsManifest, work: Callable[[int, bytes], T]
) -> list[T]:
    """Download the shards in parallel; verify each and run `work(index, data)` on it in a worker thread
    as soon as it arrives (hashing, decompressing and XOR release the GIL)."""
    where = f"run {manifest.run_id} version {manifest.version}"

    def check(index: int, data: bytes) -> T:
        ref = manifest.shards[index]
        if not _matches(ref, data):
            raise WeightsError(
                f"{where}: shard {index} is corrupt: {len(data)} bytes with sha256 "
                f"{hashlib.sha256(data).hexdigest()}, expected {ref.size} bytes with {ref.sha256}"
            )
        return work(index, data)

    async def fetch(index: int) -> T:
        try:
            data = await store.get_bytes(manifest.shards[index].uri)  # verified in the thread
        except ObjectNotFound as exc:
            raise WeightsError(f"{where}: shard {index} is missing from the object store") from exc
        return await asyncio.to_thread(check, index, data)

    return await _bounded([lambda i=i: fetch(i) for i in range(len(manifest.shards))])


def _check_hash(where: str, entry: TensorEntry, tensor: torch.Tensor, how: str) -> None:
    if entry.sha256 and (got := _sha256(tensor)) != entry.sha256:
        raise WeightsError(
            f"{where}: tensor {entry.name} {how} has sha256 {got}, the manifest says {entry.sha256}; "
            "nothing is loaded"
        )


async def load_shards(*, store: ObjectStore, manifest: WeightsManifest) -> dict[str, torch.Tensor]:
    """Download and verify every shard of a full version; raise WeightsError on any mismatch."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    where = f"run {manifest.run_id} version {manifest.version}"
    if manifest.kind != "full":
        raise WeightsError(f"{where} is a delta against version {manifest.base_version}, not a full snapshot")

    def read(index: int, data: bytes) -> dict[str, torch.Tensor]:
        try:
            loaded = load(data)
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
            _check_hash(where, entry, tensor, "as stored")
        return loaded

    state: dict[str, torch.Tensor] = {}
    for part in await _fetch_shards(store=store, manifest=manifest, work=read):
        state.update(part)
    return state


async def apply_delta_shards(
    *, store: ObjectStore, manifest: WeightsManifest, base: Snapshot
) -> dict[str, torch.Tensor]:
    """The tensors of a delta version, rebuilt from its full base and checked tensor by tensor against
    the sha256 the trainer published; WeightsError on any mismatch (the base is left as it was)."""
    from crucible.model.weight_delta import DeltaError, apply_delta

    where = f"run {manifest.run_id} version {manifest.version}"
    if manifest.kind != "delta" or manifest.base_version != base.version:
        raise WeightsError(f"{where} is not a delta against version {base.version}")

    def rebuild(index: int, data: bytes) -> dict[str, torch.Tensor]:
        entries = [e for e in manifest.tensors if e.shard == index]
        try:
            bases = [base.tensors[e.name] for e in entries]
        except KeyError as exc:
            raise WeightsError(f"{where}: tensor {exc} is not in base version {base.version}") from exc
        for entry, b in zip(entries, bases, strict=True):
            if (list(b.shape), dtype_name(b.dtype)) != (entry.shape, entry.dtype):
                raise WeightsError(
                    f"{where}: tensor {entry.name} is {entry.dtype}{entry.shape}, "
                    f"{dtype_name(b.dtype)}{list(b.shape)} in base version {base.version}"
                )
        try:
            rebuilt = apply_delta(data, bases)
        except DeltaError as exc:
            raise WeightsError(f"{where}: delta shard {index} is corrupt: {exc}") from exc
        for entry, (_, sha256) in zip(entries, rebuilt, strict=True):
            if sha256 != entry.sha256:
                raise WeightsError(
                    f"{where}: tensor {entry.name} rebuilt from base version {base.version} has sha256 "
                    f"{sha256}, the manifest says {entry.sha256}; nothing is loaded"
                )
        return {e.name: t for e, (t, _) in zip(entries, rebuilt, strict=True)}

    state: dict[str, torch.Tensor] = {}
    for part in await _fetch_shards(store=store, manifest=manifest, work=rebuild):
        state.update(part)
    return state


class WeightsFollower:
    """Loads a run's versions one after another, keeping the last full snapshot in memory: a delta whose
    base is that snapshot costs one download of the delta; any other version (a replica that started
    late, restarted or missed the base) costs the base's download first. Loads are serialised."""

    def __init__(self, *, bus: Bus, store: ObjectStore, run_id: str) -> None:
        self.bus, self.store, self.run_id = bus, store, run_id
        self.base: Snapshot | None = None
        self._lock = asyncio.Lock()

    async def load(self, version: int | None = None) -> tuple[WeightsManifest, dict[str, torch.Tensor]]:
        """The manifest of `version` (the latest when None) and its verified tensors. The tensors of a
        full version, and those a delta left unchanged, are the follower's own: read them, never write."""
        async with self._lock:
            manifest = await get_manifest(bus=self.bus, run_id=self.run_id, version=version)
            if manifest.kind == "full":
                self.base = Snapshot(manifest.version, await load_shards(store=self.store, manifest=manifest))
                return manifest, self.base.tensors
            base_version = manifest.base_version
            if self.base is None or self.base.version != base_version:
                try:
                    base = await get_manifest(bus=self.bus, run_id=self.run_id, version=base_version)
                except RemoteError as exc:
                    raise WeightsError(
                        f"run {self.run_id} version {manifest.version}: its base version {base_version} "
                        f"cannot be read: {exc}"
                    ) from exc
                self.base = Snapshot(base.version, await load_shards(store=self.store, manifest=base))
            return manifest, await apply_delta_shards(store=self.store, manifest=manifest, base=self.base)


async def load_weights(
    *, bus: Bus, store: ObjectStore, run_id: str, version: int | None = None
) -> tuple[WeightsManifest, dict[str, torch.Tensor]]:
    """Fetch a version's manifest (the latest when None) and its verified tensors, full or delta."""
    return await WeightsFollower(bus=bus, store=store, run_id=run_id).load(version)


async def committed_weights(
    *, bus: Bus, store: ObjectStore, run_id: str, version: int
) -> dict[str, torch.Tensor] | None:
    """`version`'s verified tensors, or None when it was never committed."""
    if await _committed(bus=bus, run_id=run_id, version=version) is None:
        return None
    return (await load_weights(bus=bus, store=store, run_id=run_id, version=version))[1]
