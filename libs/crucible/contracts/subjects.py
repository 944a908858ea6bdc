"""Every subject and stream name on the bus, in one place.

Request/reply subjects are served by queue groups (one replica answers). Stream subjects are durable:
JetStream keeps them until the consumers named here have acknowledged them.
"""

# Request/reply (core NATS, queue groups).
CATALOG_SAMPLE = "catalog.sample"
CATALOG_GET = "catalog.get"
SANDBOX_CREATE = "sandbox.create"
# Once created, a session lives on one replica: calls go to sandbox.<replica>.<verb>.
SANDBOX_CALL = "sandbox.{replica}.{verb}"
CHECKPOINTS_COMMIT = "checkpoints.commit"
CHECKPOINTS_GET = "checkpoints.get"

# Streams: name -> subjects.
RUNS = "RUNS"
RUNS_CREATED_ALL = "runs.*.created"
ROLLOUTS = "ROLLOUTS"
GRADED = "GRADED"
EVENTS = "EVENTS"
WEIGHTS = "WEIGHTS"
DEAD_LETTER = "DEADLETTER"

STREAMS: dict[str, list[str]] = {
    RUNS: ["runs.>"],
    ROLLOUTS: ["rollouts.>"],
    GRADED: ["graded.>"],
    EVENTS: ["events.>"],
    WEIGHTS: ["weights.>"],
    DEAD_LETTER: ["deadletter.>"],
}

# Durable consumer names.
GRADER_DURABLE = "grader"
TRAINER_DURABLE = "trainer"
API_GRADED_DURABLE = "api-graded"
API_EVENTS_DURABLE = "api-events"


def run_created(run_id: str) -> str:
    return f"runs.{run_id}.created"


def run_finished(run_id: str) -> str:
    return f"runs.{run_id}.finished"


def rollouts(run_id: str) -> str:
    return f"rollouts.{run_id}"


def graded(run_id: str) -> str:
    return f"graded.{run_id}"


def events(run_id: str, kind: str) -> str:
    return f"events.{run_id}.{kind}"


def weights_announced(run_id: str) -> str:
    return f"weights.{run_id}.announced"


WEIGHTS_ANNOUNCED_ALL = "weights.*.announced"


def dead_letter(stream: str) -> str:
    return f"deadletter.{stream.lower()}"


def sandbox_call(replica: str, verb: str) -> str:
    return SANDBOX_CALL.format(replica=replica, verb=verb)
