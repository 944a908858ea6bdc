"""Every subject, stream, durable consumer and queue group name on the bus, in one place.

Request/reply subjects are served by queue groups (one replica answers). Stream subjects are durable:
JetStream keeps them until the consumers named here have acknowledged them (a work queue) or until
the stream's limits retire them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Request/reply (core NATS, queue groups).
CATALOG_SAMPLE = "catalog.sample"
CATALOG_GET = "catalog.get"
CATALOG_SECRET = "catalog.secret"
"""A task with its secret (hidden tests, reference patch, expected outcomes): the grader's and the trainer's
only (`crucible.contracts.access`); `catalog.get` never gives it."""
CATALOG_LIST = "catalog.list"
CATALOG_DESCRIBE = "catalog.describe"
SANDBOX_CREATE = "sandbox.create"
SANDBOX_LIMITS = "sandbox.limits"
# Once created, a session lives on one replica: calls go to sandbox.<replica>.<verb>.
SANDBOX_CALL = "sandbox.{replica}.{verb}"
CHECKPOINTS_COMMIT = "checkpoints.commit"
CHECKPOINTS_GET = "checkpoints.get"

# Queue groups: the replicas of one service share the request/reply subjects it serves.
CATALOG_QUEUE = "catalog"
SANDBOX_QUEUE = "sandbox"
CHECKPOINTS_QUEUE = "checkpoints"


@dataclass(frozen=True, kw_only=True)
class Stream:
    """A JetStream stream: the subjects it captures and how it retains them."""

    name: str
    subjects: tuple[str, ...]
    retention: Literal["limits", "work_queue"] = "limits"
    """work_queue: a message is removed once a consumer acknowledges it (each is worked on once);
    limits: kept for every consumer, until the limits below retire it."""
    max_age_days: float = 0
    """Messages older than this are removed (0: no age limit)."""
    max_per_subject: int = 0
    """Only the newest this many messages of each subject are kept (0: all)."""

    @property
    def all_subjects(self) -> str:
        """The filter that matches every subject of the stream."""
        return self.subjects[0]


RUNS = "RUNS"
ROLLOUTS = "ROLLOUTS"
GRADED = "GRADED"
EVENTS = "EVENTS"
WEIGHTS = "WEIGHTS"
EVALS = "EVALS"
DEAD_LETTER = "DEADLETTER"

WORK_DAYS = 30
"""How long a run's work may wait on the bus: a trajectory, grade, event or evaluation request nobody
has consumed in this long belongs to a run that ended or died (the api holds the history)."""

STREAMS: dict[str, Stream] = {
    stream.name: stream
    for stream in (
        # a run's `created` and `finished` markers are each written once; the newest is all anyone reads
        Stream(name=RUNS, subjects=("runs.>",), max_per_subject=1),
        Stream(name=ROLLOUTS, subjects=("rollouts.>",), retention="work_queue", max_age_days=WORK_DAYS),
        Stream(name=GRADED, subjects=("graded.>",), max_age_days=WORK_DAYS),
        Stream(name=EVENTS, subjects=("events.>",), max_age_days=WORK_DAYS),
        # the newest announced version of a run is what rollouts follow; older manifests are in S3
        Stream(name=WEIGHTS, subjects=("weights.>",), max_per_subject=1),
        Stream(name=EVALS, subjects=("evals.>",), max_age_days=WORK_DAYS),
        Stream(name=DEAD_LETTER, subjects=("deadletter.>",), max_age_days=3 * WORK_DAYS),  # time to look
    )
}
RUNS_CREATED_ALL = "runs.*.created"
WEIGHTS_ANNOUNCED_ALL = "weights.*.announced"

# Durable consumer names.
GRADER_DURABLE = "grader"
TRAINER_DURABLE = "trainer"
API_GRADED_DURABLE = "api-graded"
API_EVENTS_DURABLE = "api-events"
ROLLOUT_EVALS_DURABLE = "rollout-evals"
"""Shared by every rollout replica: each evaluation request is run by one of them."""


def trainer_run_durable(run_id: str) -> str:
    """The trainer's consumer of one run's graded trajectories (deleted when the run ends)."""
    return f"trainer-{run_id}"


def run_created(run_id: str) -> str:
    return f"runs.{run_id}.created"


def run_finished(run_id: str) -> str:
    return f"runs.{run_id}.finished"


def rollouts(run_id: str) -> str:
    return f"rollouts.{run_id}"


def graded(run_id: str) -> str:
    return f"graded.{run_id}"


def eval_requested(run_id: str) -> str:
    return f"evals.{run_id}.requested"


def events(run_id: str, kind: str) -> str:
    """Where a run's events of one kind go (a dot in the kind becomes '_': `run.status` -> run_status)."""
    return f"events.{run_id}.{kind.replace('.', '_')}"


def weights_announced(run_id: str) -> str:
    return f"weights.{run_id}.announced"


def dead_letter(stream: str) -> str:
    return f"deadletter.{stream.lower()}"


def sandbox_call(replica: str, verb: str) -> str:
    return SANDBOX_CALL.format(replica=replica, verb=verb)
