"""Prometheus metrics of the sandbox service."""

from prometheus_client import Counter, Gauge

SESSIONS = Gauge("crucible_sandbox_sessions", "Sessions held by this replica")
RESULTS = Counter(
    "crucible_sandbox_results_total",
    "Results of tool calls and commands, by verb, tool and whether they worked",
    ["verb", "tool", "ok"],
)
