"""Wiring of the checkpoints service: `checkpoints.commit` and `checkpoints.get` over the bus."""

from __future__ import annotations

from crucible.contracts import endpoints
from crucible.contracts.messages import CheckpointReply, CheckpointRequest, CommitReply, CommitRequest
from crucible.runtime import Runtime
from services.checkpoints import versions
from services.checkpoints.metrics import RETENTION_FAILURES, RETIRED
from services.checkpoints.retention import apply_retention
from services.checkpoints.settings import Settings


async def setup(rt: Runtime[Settings]) -> None:
    settings = rt.settings

    async def on_commit(request: CommitRequest) -> CommitReply:
        manifest = request.manifest
        ref = await versions.commit(
            bus=rt.bus, store=rt.store, manifest=manifest, chunk_bytes=settings.hash_chunk_bytes
        )
        rt.log.info("committed", run_id=manifest.run_id, version=manifest.version, manifest=ref.uri)
        try:
            retired = await apply_retention(
                store=rt.store,
                run_id=manifest.run_id,
                keep_last=settings.keep_last_versions,
                full_every=settings.full_every,
            )
        except Exception as exc:  # the commit stands; the next one retries retention
            RETENTION_FAILURES.inc()
            rt.log.warning("retention failed", run_id=manifest.run_id, error=repr(exc))
        else:
            RETIRED.inc(len(retired))
            if retired:
                rt.log.info("retired versions", run_id=manifest.run_id, versions=retired)
        return CommitReply(manifest=ref)

    async def on_get(request: CheckpointRequest) -> CheckpointReply:
        manifest = await versions.get(
            bus=rt.bus, store=rt.store, run_id=request.run_id, version=request.version
        )
        return CheckpointReply(manifest=manifest)

    await rt.bus.serve(endpoints.CHECKPOINTS_COMMIT, on_commit)
    await rt.bus.serve(endpoints.CHECKPOINTS_GET, on_get)
