"""Prometheus metrics of the sandbox service."""

from prometheus_client import Counter, Gauge, Histogram

SESSIONS = Gauge("crucible_sandbox_sessions", "Sessions held by this replica")
CALLS = Counter(
    "crucible_sandbox_calls_total", "Calls answered, by verb, tool and outcome", ["verb", "tool", "ok"]
)
CALL_SECONDS = Histogram(
    "crucible_sandbox_call_seconds",
    "Time to answer a call, by verb",
    ["verb"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300),
)
