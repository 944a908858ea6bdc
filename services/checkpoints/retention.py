"""Retention: drop old versions of a run, keeping the newest ones, every `full_every`-th, and the base of
every delta kept.

A delta version is useless without its base (crucible.clients.checkpoints), so the full version a kept
delta names is kept however old it is. Which base a delta names is read from its manifest; a kept delta
whose manifest cannot be read (its commit still under way) keeps every full version for this pass.
"""

from __future__ import annotations

from crucible.contracts import ContractError, decode
from crucible.contracts.keys import DELTA_SHARD_SUFFIX, manifest_key, version_prefix, weights_prefix
from crucible.contracts.messages import WeightsManifest
from crucible.objectstore import ObjectNotFound, ObjectStore


def versions_to_retire(*, versions: list[int], keep_last: int, full_every: int) -> list[int]:
    """Versions that neither are among the `keep_last` newest nor are a multiple of `full_every` (the
    caller then spares the bases of the deltas kept).

    keep_last == 0 keeps everything; full_every == 0 keeps no version for being a snapshot.
    """
    if keep_last <= 0:
        return []
    newest = set(sorted(versions)[-keep_last:])
    return sorted(v for v in versions if v not in newest and not (full_every > 0 and v % full_every == 0))


def parse_versions(*, keys: list[str], run_id: str) -> list[int]:
    prefix = weights_prefix(run_id)
    found = set()
    for key in keys:
        head = key.removeprefix(prefix).split("/", 1)[0]
        if head.isdigit():
            found.add(int(head))
    return sorted(found)


def _is_delta(keys: list[str], run_id: str, version: int) -> bool:
    prefix = version_prefix(run_id, version)
    return any(k.startswith(prefix) and k.endswith(DELTA_SHARD_SUFFIX) for k in keys)


async def _bases(*, store: ObjectStore, run_id: str, keys: list[str], kept: set[int]) -> set[int] | None:
    """The base versions of the kept deltas; None when one of them cannot be told."""
    bases = set()
    for version in sorted(v for v in kept if _is_delta(keys, run_id, v)):
        try:
            manifest = decode(
                await store.get_bytes(store.uri(manifest_key(run_id, version))), WeightsManifest
            )
        except (ObjectNotFound, ContractError):
            return None
        if manifest.base_version is not None:
            bases.add(manifest.base_version)
    return bases


async def apply_retention(*, store: ObjectStore, run_id: str, keep_last: int, full_every: int) -> list[int]:
    """Delete retired versions' shards and manifests; returns the versions deleted."""
    if keep_last <= 0:
        return []
    keys = await store.list(weights_prefix(run_id))
    versions = parse_versions(keys=keys, run_id=run_id)
    candidates = versions_to_retire(versions=versions, keep_last=keep_last, full_every=full_every)
    bases = await _bases(store=store, run_id=run_id, keys=keys, kept=set(versions) - set(candidates))
    if bases is None:  # keep every full version this time
        bases = {v for v in candidates if not _is_delta(keys, run_id, v)}
    retired = [v for v in candidates if v not in bases]
    prefixes = tuple(version_prefix(run_id, v) for v in retired)
    for key in sorted(keys, key=lambda k: not k.endswith("manifest.msgpack")):  # manifests go first
        if key.startswith(prefixes):
            await store.delete(key)
    return retired
