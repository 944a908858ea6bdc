"""Prometheus metrics of the trainer service."""

from prometheus_client import Counter, Gauge, Histogram

RUNS = Gauge("crucible_trainer_runs", "Runs this replica is training")
STEPS = Counter("crucible_trainer_steps_total", "Optimizer steps taken", ["run_id"])
STEP_SECONDS = Histogram(
    "crucible_trainer_step_seconds",
    "Time of one optimizer step",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
TRAJECTORIES = Counter(
    "crucible_trainer_trajectories_total",
    "Graded trajectories by what the trainer did with them: trained, stale (over the staleness bound) or "
    "alone (too few of their group left to compare against), uniform (a dropped group of equal rewards) or "
    "non_finite (in a step skipped for non-finite numbers)",
    ["run_id", "result"],
)
VERSION = Gauge("crucible_trainer_policy_version", "Newest weight version published", ["run_id"])
SKIPPED_STEPS = Counter(
    "crucible_trainer_skipped_steps_total",
    "Steps not taken for non-finite numbers, by what",
    ["run_id", "reason"],
)
