"""Run Crucible on one machine: embedded servers (NATS, SeaweedFS S3, Valkey) and every service as a
local process. Imports nothing heavy, so the CLI stays fast."""

from crucible.localstack.migrations import MigrationError, run_migrations
from crucible.localstack.servers import Server, ServerStartError, start_nats, start_redis, start_seaweedfs
from crucible.localstack.services import SERVICES, ServiceError
from crucible.localstack.stack import LocalStack

__all__ = [
    "SERVICES",
    "LocalStack",
    "MigrationError",
    "Server",
    "ServerStartError",
    "ServiceError",
    "run_migrations",
    "start_nats",
    "start_redis",
    "start_seaweedfs",
]
