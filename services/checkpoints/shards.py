"""Verifying uploaded shards against their references without holding a whole shard in memory."""

from __future__ import annotations

import asyncio
import hashlib

from minio.error import S3Error

from crucible.bus import RequestError
from crucible.contracts.messages import ObjectRef
from crucible.objectstore import ObjectStore, parse_uri

_MISSING = ("NoSuchKey", "NoSuchObject", "NotFound", "NoSuchBucket")


async def stream_digest(*, store: ObjectStore, ref: ObjectRef, chunk_bytes: int) -> tuple[str, int] | None:
    """(sha256, size) of the object behind `ref`, read in chunks; None when there is no such object."""
    bucket, key = parse_uri(ref.uri)

    def run() -> tuple[str, int] | None:
        try:
            response = store.client.get_object(bucket, key)
        except S3Error as exc:
            if exc.code in _MISSING:
                return None
            raise
        digest, size = hashlib.sha256(), 0
        try:
            for chunk in response.stream(chunk_bytes):
                digest.update(chunk)
                size += len(chunk)
        finally:
            response.close()
            response.release_conn()
        return digest.hexdigest(), size

    return await asyncio.to_thread(run)


async def verify_shards(*, store: ObjectStore, shards: list[ObjectRef], chunk_bytes: int) -> None:
    """Raise RequestError("missing_shard" | "integrity") unless every shard is there, byte for byte."""
    found = await asyncio.gather(
        *(stream_digest(store=store, ref=ref, chunk_bytes=chunk_bytes) for ref in shards)
    )
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
