"""Checks on a manifest that need nothing but the manifest itself."""

from __future__ import annotations

from crucible.bus import RequestError
from crucible.contracts.keys import version_prefix
from crucible.contracts.messages import WeightsManifest
from crucible.objectstore import parse_uri

_RUN_ID_FORBIDDEN = set("/.*> \t\n")


def check_run_id(run_id: str) -> None:
    """A run id becomes part of subjects and object keys: no separators, wildcards or blanks."""
    if not run_id or _RUN_ID_FORBIDDEN & set(run_id):
        raise RequestError("bad_run_id", f"run id {run_id!r} is empty or holds one of '/ . * >' or blanks")


def check_manifest(*, manifest: WeightsManifest, bucket: str) -> None:
    """Raise RequestError unless the manifest is well formed and its shards live where they belong."""
    check_run_id(manifest.run_id)
    if manifest.version < 0 or manifest.step < 0:
        raise RequestError("bad_version", f"version {manifest.version} and step {manifest.step} must be >= 0")
    if not manifest.shards or not manifest.tensors:
        raise RequestError("empty", "a manifest needs at least one shard and one tensor")
    prefix = version_prefix(manifest.run_id, manifest.version)
    for index, ref in enumerate(manifest.shards):
        try:
            shard_bucket, key = parse_uri(ref.uri)
        except ValueError as exc:
            raise RequestError("bad_shard", f"shard {index}: {exc}") from exc
        if shard_bucket != bucket or not key.startswith(prefix):
            raise RequestError("bad_shard", f"shard {index} ({ref.uri}) is not under s3://{bucket}/{prefix}")
        if ref.size < 0 or len(ref.sha256) != 64:
            raise RequestError("bad_shard", f"shard {index} has size {ref.size} and sha256 {ref.sha256!r}")
    seen: set[str] = set()
    used: set[int] = set()
    for entry in manifest.tensors:
        if not entry.name or entry.name in seen:
            raise RequestError("bad_tensor", f"tensor name {entry.name!r} is empty or repeated")
        seen.add(entry.name)
        if not 0 <= entry.shard < len(manifest.shards):
            raise RequestError(
                "bad_tensor", f"tensor {entry.name} points at shard {entry.shard} of {len(manifest.shards)}"
            )
        if any(d < 0 for d in entry.shape) or not entry.dtype:
            raise RequestError(
                "bad_tensor", f"tensor {entry.name} has shape {entry.shape} and dtype {entry.dtype!r}"
            )
        used.add(entry.shard)
    if unused := sorted(set(range(len(manifest.shards))) - used):
        raise RequestError("bad_shard", f"shards {unused} hold no tensor of the manifest")


def same_weights(a: WeightsManifest, b: WeightsManifest) -> bool:
    """Two commits of one version are the same if everything but their creation time agrees."""
    return (a.run_id, a.version, a.step, a.tensors, a.shards) == (
        b.run_id,
        b.version,
        b.step,
        b.tensors,
        b.shards,
    )
