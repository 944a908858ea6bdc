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
    check_kind(manifest)
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
        if (entry.sha256 or manifest.kind == "delta") and not _is_sha256(entry.sha256):
            raise RequestError("bad_tensor", f"tensor {entry.name} has sha256 {entry.sha256!r}")
        used.add(entry.shard)
    if unused := sorted(set(range(len(manifest.shards))) - used):
        raise RequestError("bad_shard", f"shards {unused} hold no tensor of the manifest")


def check_kind(manifest: WeightsManifest) -> None:
    """A full version names no base; a delta names an older version as its base (whether that one is a
    full snapshot with the same tensors needs the store: `check_delta_base`)."""
    if manifest.raw_bytes < 0:
        raise RequestError("bad_version", f"raw_bytes {manifest.raw_bytes} must be >= 0")
    if manifest.kind == "full":
        if manifest.base_version is not None:
            raise RequestError(
                "bad_base", f"full version {manifest.version} names base {manifest.base_version}"
            )
    elif manifest.base_version is None or not 0 <= manifest.base_version < manifest.version:
        raise RequestError(
            "bad_base",
            f"delta version {manifest.version} needs an older base version, not {manifest.base_version}",
        )


def check_delta_base(*, delta: WeightsManifest, base: WeightsManifest) -> None:
    """A delta applies to a full version with the same tensors, of the same shapes and dtypes."""
    if base.kind != "full":
        raise RequestError("bad_base", f"base version {base.version} is a delta, not a full snapshot")
    if sorted((e.name, e.shape, e.dtype) for e in delta.tensors) != sorted(
        (e.name, e.shape, e.dtype) for e in base.tensors
    ):
        raise RequestError(
            "bad_base",
            f"delta version {delta.version} has other tensors than its base version {base.version}",
        )


def _is_sha256(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def same_weights(a: WeightsManifest, b: WeightsManifest) -> bool:
    """Two commits of one version are the same if everything but their creation time agrees."""
    keys = ("run_id", "version", "step", "tensors", "shards", "kind", "base_version", "raw_bytes")
    return all(getattr(a, k) == getattr(b, k) for k in keys)
