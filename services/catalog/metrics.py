"""Prometheus metrics of the catalog service."""

from prometheus_client import Counter, Gauge

TASKS = Gauge(
    "crucible_catalog_tasks", "Tasks this replica found ready to serve at start, by task set", ["taskset"]
)
REJECTED = Counter("crucible_catalog_rejected_total", "Generated tasks that failed verification", ["taskset"])
