"""Prometheus metrics of the grader service."""

from prometheus_client import Counter, Histogram

TRAJECTORIES = Counter(
    "crucible_grader_trajectories_total",
    "Trajectories handled, by result: graded or duplicate (graded before)",
    ["result"],
)
REWARD = Histogram(
    "crucible_grader_reward",
    "Total reward of graded trajectories",
    buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1),
)
GRADE_SECONDS = Histogram(
    "crucible_grader_seconds", "Time to grade one trajectory", buckets=(1, 2, 5, 10, 30, 60, 120, 300, 600)
)
TAMPERED = Counter(
    "crucible_grader_tampered_total",
    "Trajectories scored 0 by the tamper scan, by run and rule",
    ["run_id", "rule"],
)
