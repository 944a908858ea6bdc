"""How a state dict is split into safetensors shards: the one rule for the checkpoint store and local
checkpoint directories."""

from __future__ import annotations

from collections.abc import Iterator

DEFAULT_SHARD_BYTES = 256 * 1024 * 1024


def plan_shards(*, sizes: dict[str, int], shard_bytes: int) -> Iterator[list[str]]:
    """Group tensor names, in order, into shards of at most `shard_bytes` (a bigger tensor is alone)."""
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    current: list[str] = []
    used = 0
    for name, size in sizes.items():
        if current and used + size > shard_bytes:
            yield current
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        yield current
