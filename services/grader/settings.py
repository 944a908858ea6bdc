"""Settings of the grader service (env prefix CRUCIBLE_)."""

from __future__ import annotations

from pydantic import Field, model_validator

from crucible.settings import CommonSettings


class Settings(CommonSettings):
    concurrency: int = Field(default=2, ge=1, le=64)
    """Trajectories this replica grades at once (one sandbox each)."""
    ack_wait_s: float = Field(default=60.0, gt=0)
    """JetStream redelivers a trajectory whose grader has been silent this long."""
    heartbeat_s: float = Field(default=15.0, gt=0)
    """How often a grader still at work tells JetStream so (must be well under ack_wait_s)."""
    max_deliver: int = Field(default=10, ge=1)
    """Attempts before a trajectory that keeps failing goes to the dead-letter subject."""
    test_timeout_s: float = Field(default=300.0, gt=0)
    """Wall-clock limit of the hidden test run; a run past it scores 0."""
    sandbox_ttl_s: float = Field(default=900.0, gt=0)
    tamper_scan: bool = True
    """Score 0 a change that adds what reaches past the code under test (services.grader.tamper); off
    only to measure what the scan stops."""
    guard: bool = True
    """Run the hidden tests under the runtime guard (`crucible.pytest_report`), which refuses and reports
    what the change's own lines do past the code under test; off only to measure what it stops."""
    catalog_timeout_s: float = Field(default=10.0, gt=0)
    sandbox_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline of one sandbox call other than the test run (create, apply, overlay)."""
    graded_key_ttl_s: int = Field(default=7 * 86400, ge=60)
    """Lifetime of the Redis marker that lets a redelivered, already graded trajectory skip work."""

    @model_validator(mode="after")
    def _heartbeat_within_ack_wait(self) -> Settings:
        if self.heartbeat_s >= self.ack_wait_s:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s}) must be shorter than ack_wait_s ({self.ack_wait_s})"
            )
        return self
