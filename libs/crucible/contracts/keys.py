"""Every object-store key and Redis key that more than one place reads or writes.

Object store layout (one bucket):

    tasksets/<set>/<task>/<file>                 task snapshots and hidden tests (catalog)
    runs/<run>/weights/<version:06d>/...         weight manifests and shards (trainer, checkpoints)
    runs/<run>/trainer/state-{0,1}/...           the trainer's last two resumable states (index + rank files)
    runs/<run>/trajectories/<trajectory>/...     trajectories too big for a message (rollout, grader)
    bus/<subject>/<sha256>.msgpack               any other message too big for the bus

Redis holds short-lived coordination only. Losing Redis loses no data: each key can be rebuilt or only
costs some duplicated work (which JetStream de-duplication then absorbs).
"""

from __future__ import annotations

DAY_S = 86400

# --- object store ----------------------------------------------------------------------------------


def taskset_object(taskset: str, task_id: str, filename: str) -> str:
    return f"tasksets/{taskset}/{task_id}/{filename}"


def weights_prefix(run_id: str) -> str:
    return f"runs/{run_id}/weights/"


def version_prefix(run_id: str, version: int) -> str:
    return f"{weights_prefix(run_id)}{version:06d}/"


def shard_key(run_id: str, version: int, index: int) -> str:
    return f"{version_prefix(run_id, version)}shard-{index}.safetensors"


DELTA_SHARD_SUFFIX = ".xor.zst"


def delta_shard_key(run_id: str, version: int, index: int) -> str:
    """A delta version's shard: zstd-compressed XOR with its base (crucible.model.weight_delta)."""
    return f"{version_prefix(run_id, version)}delta-{index}{DELTA_SHARD_SUFFIX}"


def manifest_key(run_id: str, version: int) -> str:
    return f"{version_prefix(run_id, version)}manifest.msgpack"


def trainer_state_key(run_id: str, slot: int, name: str = "state.json") -> str:
    """The trainer keeps its last two states, written in turn to slots 0 and 1: each the ranks' sharded
    checkpoint files and, written last, the index `state.json` that names them."""
    return f"runs/{run_id}/trainer/state-{slot}/{name}"


def run_trajectories_prefix(run_id: str) -> str:
    """Every trajectory object of a run (released by the api once the run is over and settled)."""
    return f"runs/{run_id}/trajectories/"


def trajectory_claim_prefix(run_id: str, trajectory_id: str) -> str:
    """Where a rollout parks a trajectory too big for the bus."""
    return f"{run_trajectories_prefix(run_id)}{trajectory_id}"


def graded_claim_prefix(run_id: str, trajectory_id: str) -> str:
    """Where a grader parks a graded trajectory too big for the bus."""
    return f"{trajectory_claim_prefix(run_id, trajectory_id)}/graded"


def bus_claim_prefix(subject: str) -> str:
    """Where any other message too big for the bus is parked."""
    return f"bus/{subject}"


# --- Redis -----------------------------------------------------------------------------------------


def admitted_key(run_id: str) -> str:
    """Groups admitted so far by all rollout replicas of a run."""
    return f"crucible:run:{run_id}:admitted"


def released_key(run_id: str) -> str:
    """Group indices given back by rollouts whose group produced nothing; the next admission reuses one."""
    return f"crucible:run:{run_id}:released"


def refills_key(run_id: str) -> str:
    """Groups the trainer dropped (all rewards equal, DAPO dynamic sampling); each makes room for one more."""
    return f"crucible:run:{run_id}:refills"


def finished_key(run_id: str) -> str:
    """Set by the trainer when a run has taken its last step."""
    return f"crucible:run:{run_id}:finished"


def graded_key(trajectory_id: str) -> str:
    """Set by the grader after a trajectory's graded message was acknowledged by the stream."""
    return f"crucible:graded:{trajectory_id}"


def sandbox_sessions_key(replica: str) -> str:
    """The sessions a sandbox replica holds (a restarted replica releases them all)."""
    return f"crucible:sandbox:replica:{replica}:sessions"


def sandbox_lease_key(session_id: str) -> str:
    """A session's lease (value: its replica), renewed by every call; it mirrors the replica's registry."""
    return f"crucible:sandbox:lease:{session_id}"
