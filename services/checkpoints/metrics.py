"""Prometheus metrics of the checkpoints service (requests themselves are counted by the bus)."""

from prometheus_client import Counter

ANNOUNCED = Counter("crucible_checkpoints_announced_total", "Weight versions verified and announced")
COMMITTED_BYTES = Counter(
    "crucible_checkpoints_committed_bytes_total", "Shard bytes of the versions announced"
)
RETIRED = Counter("crucible_checkpoints_retired_total", "Weight versions deleted by retention")
RETENTION_FAILURES = Counter(
    "crucible_checkpoints_retention_failures_total",
    "Retention passes that failed (retried on the next commit)",
)
