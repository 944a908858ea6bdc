"""Redis keys for short-lived coordination. Losing Redis loses no data: each key can be rebuilt or only
costs some duplicated work (which JetStream de-duplication then absorbs)."""

DAY_S = 86400


def admitted_key(run_id: str) -> str:
    """Groups admitted so far by all rollout replicas of a run."""
    return f"crucible:run:{run_id}:admitted"


def finished_key(run_id: str) -> str:
    """Set by the trainer when a run has taken its last step."""
    return f"crucible:run:{run_id}:finished"


def graded_key(trajectory_id: str) -> str:
    """Set by the grader after a trajectory's graded message was acknowledged by the stream."""
    return f"crucible:graded:{trajectory_id}"


def sandbox_replica_key(replica: str) -> str:
    """A sandbox replica's heartbeat; when it lapses, any replica on that machine may sweep its leftovers."""
    return f"crucible:sandbox:replica:{replica}"


def sandbox_sessions_key(replica: str) -> str:
    """The sessions a sandbox replica holds (a restarted replica releases them all)."""
    return f"crucible:sandbox:replica:{replica}:sessions"


def sandbox_lease_key(session_id: str) -> str:
    """A session's lease (value: its replica), renewed by every call; when it lapses, the session is reaped."""
    return f"crucible:sandbox:lease:{session_id}"
