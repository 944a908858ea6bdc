from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from crucible.contracts import subjects
from crucible.settings import CommonSettings


class Settings(CommonSettings):
    api_host: str = "127.0.0.1"
    """Interface the REST API listens on."""
    api_port: int = Field(default=8000, ge=0, le=65535)
    """REST API port; 0 picks a free port."""
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    """A request body longer than this is refused with a 413 before it is read."""
    write_rate_per_s: float = Field(default=5.0, gt=0)
    """Writes (runs started or cancelled, evaluations, keys) one API key may make per second, sustained."""
    write_burst: int = Field(default=50, ge=1)
    """Writes one API key may make at once before `write_rate_per_s` applies (a 429 past it)."""
    ingest_batch: int = Field(default=1, ge=1, le=1024)
    """Stream messages fetched per pull while ingesting."""
    ingest_max_deliver: int = Field(default=5, ge=1)
    """Deliveries of a message that keeps failing before it is dead-lettered."""
    graded_durable: str = Field(default=subjects.API_GRADED_DURABLE, pattern=r"^[A-Za-z0-9_-]+$")
    """Durable consumer on GRADED; api replicas of one deployment share it."""
    events_durable: str = Field(default=subjects.API_EVENTS_DURABLE, pattern=r"^[A-Za-z0-9_-]+$")
    """Durable consumer on EVENTS; api replicas of one deployment share it."""
    release_objects_after_s: float = Field(default=3600.0, ge=0)
    """How long after a run ends its trajectory objects stay in the object store (they go once the run
    is also settled: everything graded and ingested)."""
    cleanup_every_s: float = Field(default=300.0, gt=0)
    """How often ended runs are looked at for that."""
    tracking_dir: Path = Path(".crucible/tracking")
    """Where the trackers a run asks for (`trackers` in its config) write: TensorBoard event files, the
    default MLflow store (SQLite), Weights & Biases offline runs."""
    mlflow_tracking_uri: str | None = None
    """An MLflow tracking server (or any MLflow URI) instead of the SQLite store under tracking_dir."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """Weights & Biases mode; online needs WANDB_API_KEY and network access."""
