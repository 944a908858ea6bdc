"""Retention: drop old versions of a run, keeping the newest ones and every `full_every`-th.

Every version is a full snapshot today; compressed deltas between full snapshots are a later change,
and then a delta's base must outlive it (the `full_every` versions are those bases).
"""

from __future__ import annotations

from crucible.contracts.keys import version_prefix, weights_prefix
from crucible.objectstore import ObjectStore


def versions_to_retire(*, versions: list[int], keep_last: int, full_every: int) -> list[int]:
    """Versions that neither are among the `keep_last` newest nor are a multiple of `full_every`.

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


async def apply_retention(*, store: ObjectStore, run_id: str, keep_last: int, full_every: int) -> list[int]:
    """Delete retired versions' shards and manifests; returns the versions deleted."""
    if keep_last <= 0:
        return []
    keys = await store.list(weights_prefix(run_id))
    retired = versions_to_retire(
        versions=parse_versions(keys=keys, run_id=run_id), keep_last=keep_last, full_every=full_every
    )
    prefixes = tuple(version_prefix(run_id, v) for v in retired)
    for key in sorted(keys, key=lambda k: not k.endswith("manifest.msgpack")):  # manifests go first
        if key.startswith(prefixes):
            await store.delete(key)
    return retired
