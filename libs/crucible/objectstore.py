"""The object store: a thin async layer over the `minio` S3 client.

Works against any S3 server (SeaweedFS embedded, MinIO in compose). Every put returns an `ObjectRef`
with the payload's sha256, and every get can verify it, so a torn or tampered object is caught where
it is read. The minio client is synchronous; calls run in worker threads.

A missing object raises `ObjectNotFound` and a torn one `IntegrityError` (the reference is at fault);
a store that cannot be reached, or answers with any other S3 error (a server error, throttling, a bad
credential or a missing bucket), raises `crucible.outage.Unavailable`: it is never the caller's data.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
from collections.abc import Callable
from typing import Any, TypeVar

import urllib3
from minio import Minio
from minio.error import MinioException, S3Error

from crucible.contracts.messages import ObjectRef
from crucible.outage import Unavailable
from crucible.settings import CommonSettings

# S3 error codes that mean "no such object" (servers differ between get and stat).
_MISSING = frozenset({"NoSuchKey", "NoSuchObject", "NoSuchBucket", "NotFound"})
T = TypeVar("T")


class IntegrityError(RuntimeError):
    """An object's bytes do not match the sha256 its reference promises."""


class ObjectNotFound(KeyError):
    pass


def parse_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://") or "/" not in uri[5:]:
        raise ValueError(f"not an s3://bucket/key uri: {uri!r}")
    bucket, key = uri[5:].split("/", 1)
    return bucket, key


class AccessRefused(RuntimeError):
    """The store refused this credential the key (`crucible.contracts.access`): a bug or a forgery, not an
    outage, so nothing waits it out."""


class ObjectStore:
    def __init__(self, client: Minio, bucket: str) -> None:
        self.client = client
        self.bucket = bucket

    @classmethod
    def from_settings(cls, settings: CommonSettings) -> ObjectStore:
        verify: dict[str, Any] = (
            {"cert_reqs": "CERT_REQUIRED", "ca_certs": str(settings.s3_ca_file)}
            if settings.s3_ca_file
            else {}
        )
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=5, read=60),
            maxsize=16,
            retries=urllib3.Retry(total=3, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
            **verify,
        )
        client = Minio(
            settings.s3_endpoint,
            access_key=settings.s3_access_key,
            secret_key=settings.s3_secret_key,
            secure=settings.s3_secure,
            region=settings.s3_region,
            http_client=http,
        )
        return cls(client, settings.s3_bucket)

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    async def _run(self, call: Callable[[], T]) -> T:
        """Run a blocking minio call in a worker thread; transport and server failures become
        `Unavailable`."""
        try:
            return await asyncio.to_thread(call)
        except S3Error as exc:
            if exc.code == "AccessDenied":
                raise AccessRefused(
                    f"the object store refused this key {exc.resource or ''}: {exc.message}"
                ) from exc
            raise Unavailable(f"object store refused: {exc.code}: {exc.message}") from exc
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise Unavailable(f"object store unreachable: {type(exc).__name__}: {exc}") from exc

    async def ensure_bucket(self) -> None:
        """Make the bucket if it is missing. A key limited to some prefixes (`crucible.contracts.access`) may
        not look at the bucket as a whole: then the operator made it, and the first object says if not."""

        def run() -> None:
            try:
                if self.client.bucket_exists(self.bucket):
                    return
                self.client.make_bucket(self.bucket)
            except S3Error as exc:
                if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists", "AccessDenied"):
                    raise

        await self._run(run)

    async def check(self) -> None:
        """Raise unless the object store answers and the bucket is there (a readiness probe); a key limited
        to some prefixes, which the store answers AccessDenied for the bucket, passes: the store answered."""

        def run() -> None:
            try:
                exists = self.client.bucket_exists(self.bucket)
            except S3Error as exc:
                if exc.code == "AccessDenied":
                    return
                raise
            if not exists:
                raise ObjectNotFound(f"bucket {self.bucket} does not exist")

        await self._run(run)

    async def put_bytes(
        self, key: str, data: bytes, *, content_type: str = "application/octet-stream"
    ) -> ObjectRef:
        digest = hashlib.sha256(data).hexdigest()

        def run() -> None:
            self.client.put_object(
                self.bucket,
                key,
                io.BytesIO(data),
                len(data),
                content_type=content_type,
                metadata={"sha256": digest},
            )

        await self._run(run)
        return ObjectRef(uri=self.uri(key), sha256=digest, size=len(data))

    def _open(self, uri: str):
        """The object's response stream (blocking); the caller closes it."""
        bucket, key = parse_uri(uri)
        try:
            return self.client.get_object(bucket, key)
        except S3Error as exc:
            if exc.code in _MISSING:
                raise ObjectNotFound(uri) from exc
            raise

    async def get_bytes(self, ref: ObjectRef | str, *, verify: bool = True) -> bytes:
        uri = ref.uri if isinstance(ref, ObjectRef) else ref

        def run() -> bytes:
            response = self._open(uri)
            try:
                return response.read()
            finally:
                response.close()
                response.release_conn()

        data = await self._run(run)
        if verify and isinstance(ref, ObjectRef):
            digest = hashlib.sha256(data).hexdigest()
            if digest != ref.sha256 or len(data) != ref.size:
                raise IntegrityError(
                    f"{uri}: sha256 {digest} size {len(data)}, expected {ref.sha256} size {ref.size}"
                )
        return data

    async def digest(self, ref: ObjectRef | str, *, chunk_bytes: int = 8 << 20) -> tuple[str, int]:
        """(sha256, size) of an object, streamed in chunks so a large one never sits in memory."""
        uri = ref.uri if isinstance(ref, ObjectRef) else ref

        def run() -> tuple[str, int]:
            response = self._open(uri)
            digest, size = hashlib.sha256(), 0
            try:
                for chunk in response.stream(chunk_bytes):
                    digest.update(chunk)
                    size += len(chunk)
            finally:
                response.close()
                response.release_conn()
            return digest.hexdigest(), size

        return await self._run(run)

    async def exists(self, key: str) -> bool:
        def run() -> bool:
            try:
                self.client.stat_object(self.bucket, key)
                return True
            except S3Error as exc:
                if exc.code in _MISSING:
                    return False
                raise

        return await self._run(run)

    async def delete(self, key: str) -> None:
        await self._run(lambda: self.client.remove_object(self.bucket, key))

    async def list(self, prefix: str) -> list[str]:
        def run() -> list[str]:
            listed = self.client.list_objects(self.bucket, prefix=prefix, recursive=True)
            return [o.object_name for o in listed if o.object_name is not None]  # always set in a listing

        return await self._run(run)
