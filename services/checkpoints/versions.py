"""Committing and looking up weight versions.

A version exists once its manifest is in the object store and its announcement is on the WEIGHTS
stream; the announcement is what makes it visible. A delta version is committed only on top of a
committed full version with the same tensors (its base). Committing is idempotent: the trainer retries after a
crash, and an identical re-commit re-publishes with the same message ids, which JetStream de-duplicates.
"""

from __future__ import annotations

import hashlib

from crucible.bus import Bus, RequestError
from crucible.contracts import ContractError, decode, encode, subjects
from crucible.contracts.events import CheckpointPublished, Event
from crucible.contracts.keys import manifest_key
from crucible.contracts.messages import ObjectRef, WeightsAnnounced, WeightsManifest
from crucible.objectstore import ObjectNotFound, ObjectStore
from services.checkpoints.metrics import ANNOUNCED, COMMITTED_BYTES
from services.checkpoints.shards import verify_shards
from services.checkpoints.validation import check_delta_base, check_manifest, check_run_id, same_weights


async def latest_announced(*, bus: Bus, run_id: str) -> WeightsAnnounced | None:
    return await bus.latest(subjects.WEIGHTS, subjects.weights_announced(run_id), WeightsAnnounced)


async def read_manifest(*, store: ObjectStore, ref: ObjectRef | str) -> WeightsManifest:
    try:
        return decode(await store.get_bytes(ref), WeightsManifest)
    except ContractError as exc:
        raise RequestError("corrupt_manifest", f"{ref}: {exc}") from exc


async def commit(*, bus: Bus, store: ObjectStore, manifest: WeightsManifest, chunk_bytes: int) -> ObjectRef:
    """Verify the uploaded shards, store the manifest and announce the version."""
    check_manifest(manifest=manifest, bucket=store.bucket)
    key = manifest_key(manifest.run_id, manifest.version)
    latest = await latest_announced(bus=bus, run_id=manifest.run_id)
    if latest is not None and manifest.version <= latest.version:
        ref = await _recommit(store=store, manifest=manifest, key=key, latest=latest)
        if manifest.version < latest.version:
            return ref  # re-announcing an older version would make it the latest again
    else:
        if manifest.kind == "delta":
            await _check_base(store=store, manifest=manifest)
        await verify_shards(store=store, shards=manifest.shards, chunk_bytes=chunk_bytes)
        ref = await _stored_if_same(store=store, manifest=manifest, key=key)
        if ref is None:
            ref = await store.put_bytes(key, encode(manifest), content_type="application/msgpack")
    await announce(bus=bus, manifest=manifest, ref=ref)
    return ref


async def _check_base(*, store: ObjectStore, manifest: WeightsManifest) -> None:
    """A delta is committed only while its base is there to apply it to (retention keeps it from then on)."""
    assert manifest.base_version is not None  # check_kind: a delta names its base
    try:
        base = await read_manifest(
            store=store, ref=store.uri(manifest_key(manifest.run_id, manifest.base_version))
        )
    except ObjectNotFound as exc:
        raise RequestError(
            "bad_base",
            f"delta version {manifest.version}: base version {manifest.base_version} is not committed",
        ) from exc
    check_delta_base(delta=manifest, base=base)


async def _stored_if_same(*, store: ObjectStore, manifest: WeightsManifest, key: str) -> ObjectRef | None:
    """A retried commit (the first still verifying, or announced after the trainer gave up waiting)
    keeps the manifest already stored, so the announcement and the object never disagree."""
    try:
        data = await store.get_bytes(store.uri(key))
        stored = decode(data, WeightsManifest)
    except (ObjectNotFound, ContractError):
        return None
    if not same_weights(stored, manifest):
        return None
    return ObjectRef(uri=store.uri(key), sha256=hashlib.sha256(data).hexdigest(), size=len(data))


async def _recommit(
    *, store: ObjectStore, manifest: WeightsManifest, key: str, latest: WeightsAnnounced
) -> ObjectRef:
    ref = await _stored_if_same(store=store, manifest=manifest, key=key)
    if ref is None:
        raise RequestError(
            "bad_version",
            f"run {manifest.run_id} has announced version {latest.version}; version {manifest.version} "
            "must be newer, or an identical re-commit of a committed version",
        )
    return ref


async def announce(*, bus: Bus, manifest: WeightsManifest, ref: ObjectRef) -> None:
    run_id, version = manifest.run_id, manifest.version
    announced = WeightsAnnounced(run_id=run_id, version=version, step=manifest.step, manifest=ref)
    await bus.publish(subjects.weights_announced(run_id), announced, msg_id=f"{run_id}/weights/{version}")
    published = CheckpointPublished(
        version=version,
        step=manifest.step,
        manifest_uri=ref.uri,
        num_tensors=len(manifest.tensors),
        size_bytes=sum(s.size for s in manifest.shards),
        weights=manifest.kind,
        base_version=manifest.base_version,
        raw_bytes=manifest.raw_bytes,
    )
    event = Event.now(run_id, published, source="checkpoints")
    await bus.publish(event.subject, event, msg_id=event.msg_id)
    ANNOUNCED.inc()
    COMMITTED_BYTES.inc(published.size_bytes)


async def get(*, bus: Bus, store: ObjectStore, run_id: str, version: int | None) -> WeightsManifest:
    """The manifest of an announced version (the latest when None)."""
    check_run_id(run_id)
    latest = await latest_announced(bus=bus, run_id=run_id)
    if latest is None:
        raise RequestError("not_found", f"run {run_id} has no announced weights")
    if version is None or version == latest.version:
        return await read_manifest(store=store, ref=latest.manifest)
    if not 0 <= version < latest.version:
        raise RequestError("not_found", f"run {run_id} has no version {version} (latest is {latest.version})")
    try:
        return await read_manifest(store=store, ref=store.uri(manifest_key(run_id, version)))
    except ObjectNotFound as exc:
        raise RequestError(
            "not_found", f"run {run_id} version {version} was never committed or was retired"
        ) from exc
