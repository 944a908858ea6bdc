from pydantic import Field, model_validator

from crucible.settings import CommonSettings


class Settings(CommonSettings):
    trainer_torch_threads: int = Field(default=1, ge=1)
    trainer_group_timeout_s: float = Field(default=180.0, gt=0)
    """A group still incomplete after this long is trained with the members it has (at least two)."""
    trainer_ack_wait_s: float = Field(default=60.0, gt=0)
    """A run or graded message held by a trainer that stopped extending it goes back to the stream
    after this long (so another trainer, or this one restarted, picks it up)."""
    trainer_heartbeat_s: float = Field(default=20.0, gt=0)
    """How often held messages get their ack deadline extended; shorter than trainer_ack_wait_s."""

    @model_validator(mode="after")
    def _heartbeat_within_ack_wait(self) -> "Settings":
        if self.trainer_heartbeat_s >= self.trainer_ack_wait_s:
            raise ValueError("trainer_heartbeat_s must be shorter than trainer_ack_wait_s")
        return self
