from pathlib import Path

from pydantic import Field, model_validator

from crucible.settings import CommonSettings


class Settings(CommonSettings):
    torch_threads: int = Field(default=1, ge=1)
    """Torch threads of the trainer and of each of its local ranks."""
    max_runs: int = Field(default=4, ge=1, le=256)
    """Runs this replica trains at once (a model and an optimizer each); further runs wait in order."""
    group_timeout_s: float = Field(default=180.0, gt=0)
    """A group still incomplete after this long is trained with the members it has (at least two)."""
    ack_wait_s: float = Field(default=60.0, gt=0)
    """A run or graded message held by a trainer that stopped extending it goes back to the stream
    after this long (so another trainer, or this one restarted, picks it up)."""
    max_context: int = Field(default=2048, ge=256)
    """Tokens per demonstration episode (the rollouts' `max_context`: a demonstration longer than the
    policy's episodes would be is left out)."""
    tool_timeout_s: float = Field(default=10.0, gt=0)
    """Deadline for one tool call of a demonstration."""
    demo_concurrency: int = Field(default=2, ge=1, le=64)
    """Demonstrations played in sandboxes at once."""
    stall_timeout_s: float = Field(default=1800.0, gt=0)
    """A run to which no graded trajectory has come for this long fails, saying so (its rollouts are gone,
    or none can serve its config), instead of holding its trainer forever."""
    max_nonfinite_steps: int = Field(default=3, ge=1)
    """Steps in a row skipped for non-finite rewards, advantages, loss or gradients after which the run
    fails (with that reason)."""
    step_timeout_s: float = Field(default=900.0, gt=0)
    """Deadline of one call on a run's worker group (starting it, a step, a save, gathering the weights)
    and of each collective inside it: a rank that hangs past it breaks the group, and the run resumes
    from its last saved state."""
    ray_address: str = ""
    """The Ray cluster that runs `parallel.launcher = "ray"` runs (`ray://host:10001`, `host:6379` or
    `auto`); empty: a private single-node cluster the trainer starts on first use."""
    state_dir: Path | None = None
    """Where ranks write a run's sharded state before it goes to the object store (default: the system's
    temporary directory). With Ray on several nodes, a volume every node mounts at this same path."""
    full_every: int = Field(default=10, ge=1)
    """A run's weight versions are exact deltas against the last full snapshot, which is published every
    this many versions (and first after a restart); the checkpoints service's `full_every` should match."""
    heartbeat_s: float = Field(default=20.0, gt=0)
    """How often held messages get their ack deadline extended; shorter than ack_wait_s."""

    @model_validator(mode="after")
    def _heartbeat_within_ack_wait(self) -> "Settings":
        if self.heartbeat_s >= self.ack_wait_s:
            raise ValueError("heartbeat_s must be shorter than ack_wait_s")
        return self
