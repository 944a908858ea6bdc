from pydantic import Field

from crucible.settings import CommonSettings


class Settings(CommonSettings):
    trainer_torch_threads: int = Field(default=1, ge=1)
    trainer_group_timeout_s: float = Field(default=180.0, gt=0)
    """A group still incomplete after this long is trained with the members it has (at least two)."""
    trainer_heartbeat_s: float = Field(default=20.0, gt=0, lt=60)
    """How often held messages get their ack deadline extended (the shortest ack wait is 60 s)."""
