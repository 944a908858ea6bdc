"""Prometheus metrics of the rollout service."""

from prometheus_client import Counter, Gauge

EPISODES = Counter("crucible_rollout_episodes_total", "Episodes finished", ["run_id", "finish_reason"])
TOKENS = Counter("crucible_rollout_tokens_total", "Tokens in finished episodes", ["run_id"])
VERSION = Gauge("crucible_rollout_policy_version", "Policy version loaded", ["run_id"])
GROUPS_IN_FLIGHT = Gauge(
    "crucible_rollout_groups_in_flight", "Admitted groups not yet published (sampling, rolling out, publishing)",
    ["run_id"],
)
