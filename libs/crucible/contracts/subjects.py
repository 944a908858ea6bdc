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
CATALOG_LIST = "catalog.list"
SANDBOX_CREATE = "sandbox.create"
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
    limits: kept for every consumer, until the server's limits retire it."""

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

STREAMS: dict[str, Stream] = {
    stream.name: stream
    for stream in (
        Stream(name=RUNS, subjects=("runs.>",)),
        Stream(name=ROLLOUTS, subjects=("rollouts.>",), retention="work_queue"),
        Stream(name=GRADED, subjects=("graded.>",)),
        Stream(name=EVENTS, subjects=("events.>",)),
        Stream(name=WEIGHTS, subjects=("weights.>",)),
        Stream(name=EVALS, subjects=("evals.>",)),
        Stream(name=DEAD_LETTER, subjects=("deadletter.>",)),
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
