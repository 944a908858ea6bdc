"""Settings shared by every service (env prefix CRUCIBLE_). Each service subclasses this in its own
services/<name>/settings.py and adds only what it needs."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CRUCIBLE_", extra="ignore", frozen=True)

    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server with JetStream enabled."""
    nats_nkey_file: Path | None = None
    """This service's bus identity: a file holding its NKey seed (`crucible.identities`). None connects
    without one, to a server that asks for none."""
    nats_tls_ca_file: Path | None = None
    """The CA certificate(s) that sign the NATS server's: the connection is TLS, the server verified."""
    s3_endpoint: str = "127.0.0.1:8333"
    """S3 API endpoint, host:port (MinIO, SeaweedFS or any S3 server)."""
    s3_access_key: str = ""
    s3_secret_key: str = ""
    """The S3 key; none is written in code (the local stack makes one, a deployment gives its own)."""
    s3_key_file: Path | None = None
    """This service's own S3 key, from a file (`crucible.identities`: the access key and the secret key on
    two lines); it replaces s3_access_key and s3_secret_key."""
    s3_bucket: str = "crucible"
    s3_secure: bool = False
    """HTTPS to the S3 endpoint."""
    s3_ca_file: Path | None = None
    """With s3_secure, the CA certificate(s) that sign the S3 server's (else the system's)."""
    s3_region: str = "us-east-1"
    """Named so that the client never asks the bucket's location, which a key limited to some prefixes may
    not (MinIO's and SeaweedFS's default region)."""
    database_url: str = "sqlite+aiosqlite:///crucible.db"
    """SQLAlchemy async URL: postgresql+asyncpg://... in production, SQLite as the embedded default."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=0, ge=0, le=65535)
    """Health, readiness and /metrics; 0 picks a free port."""
    replica: str = Field(default_factory=lambda: f"{socket.gethostname().split('.')[0]}-{os.getpid()}")
    """This replica's name; must be unique among replicas of one service."""
    log_level: str = "INFO"
    log_json: bool = False
    claim_check_bytes: int = Field(default=512 * 1024, ge=1024, le=900 * 1024)
    """Payloads larger than this go to the object store; the message carries a reference. NATS refuses
    messages over 1 MiB by default, and a dead letter carries the original payload."""
    serve_concurrency: int = Field(default=64, ge=1)
    """Requests one replica handles at once on each endpoint it serves; the ones beyond wait their turn
    (`crucible_bus_requests_waiting`)."""

    @model_validator(mode="before")
    @classmethod
    def _s3_key_from_file(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("s3_key_file"):
            from crucible.identities import read_s3_key

            try:
                data["s3_access_key"], data["s3_secret_key"] = read_s3_key(Path(data["s3_key_file"]))
            except OSError as exc:
                raise ValueError(
                    f"s3_key_file {data['s3_key_file']} cannot be read: {exc.strerror}"
                ) from None
        return data
