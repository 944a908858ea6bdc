"""Verifying uploaded shards against their references without holding a whole shard in memory."""

from __future__ import annotations

import asyncio

from crucible.bus import RequestError
from crucible.contracts.messages import ObjectRef
from crucible.objectstore import ObjectNotFound, ObjectStore


async def _digest(*, store: ObjectStore, ref: ObjectRef, chunk_bytes: int) -> tuple[str, int] | None:
    try:
        return await store.digest(ref, chunk_bytes=chunk_bytes)
    except ObjectNotFound:
        return None


async def verify_shards(*, store: ObjectStore, shards: list[ObjectRef], chunk_bytes: int) -> None:
    """Raise RequestError("missing_shard" | "integrity") unless every shard is there, byte for byte."""
    found = await asyncio.gather(*(_digest(store=store, ref=ref, chunk_bytes=chunk_bytes) for ref in shards))
    for index, (ref, got) in enumerate(zip(shards, found, strict=True)):
        if got is None:
            raise RequestError("missing_shard", f"shard {index} ({ref.uri}) is not in the object store")
        sha256, size = got
        if (sha256, size) != (ref.sha256, ref.size):
            raise RequestError(
                "integrity",
                f"shard {index} ({ref.uri}) is {size} bytes with sha256 {sha256}, "
                f"expected {ref.size} bytes with {ref.sha256}",
            )
