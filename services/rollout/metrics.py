"""Prometheus metrics of the rollout service."""

from prometheus_client import Counter, Gauge, Histogram

EPISODES = Counter("crucible_rollout_episodes_total", "Episodes finished", ["run_id", "finish_reason"])
TOKENS = Counter("crucible_rollout_tokens_total", "Tokens in finished episodes", ["run_id"])
VERSION = Gauge("crucible_rollout_policy_version", "Policy version loaded", ["run_id"])
GROUPS_IN_FLIGHT = Gauge(
    "crucible_rollout_groups_in_flight",
    "Admitted groups not yet published (sampling, rolling out, publishing)",
    ["run_id"],
)
SECONDS = (1, 2, 5, 10, 30, 60, 120, 300, 600)
GROUP_SECONDS = Histogram(
    "crucible_rollout_group_seconds",
    "Time of one group, from its admission to its trajectories' publication",
    ["run_id"],
    buckets=SECONDS,
)
BUSY_SECONDS = Counter(
    "crucible_rollout_busy_seconds_total",
    "Wall-clock seconds with at least one admitted group of the run in flight on this replica (counted when "
    "the replica falls idle)",
    ["run_id"],
)
LOAD_SECONDS = Histogram(
    "crucible_rollout_weights_load_seconds",
    "Time from a version's announcement to its weights swapped in",
    ["run_id"],
    buckets=(0.1, 0.5, *SECONDS),
)
