"""Settings of the checkpoints service (env prefix CRUCIBLE_)."""

from __future__ import annotations

from pydantic import Field

from crucible.settings import CommonSettings


class Settings(CommonSettings):
    keep_last_versions: int = Field(default=0, ge=0)
    """Keep the shards of this many newest versions of a run; 0 keeps every version."""
    full_every: int = Field(default=10, ge=0)
    """Versions whose number is a multiple of this survive retention (0: none are kept for it). The bases
    of kept deltas survive whatever this says; the trainer's publisher has its own `full_every` (which
    versions are full), best set to the same number."""
    hash_chunk_bytes: int = Field(default=4 * 1024 * 1024, ge=64 * 1024)
    """Shards are hashed while streamed from the object store, this many bytes at a time."""
