from pydantic import Field

from crucible.settings import CommonSettings


class Settings(CommonSettings):
    concurrent_groups: int = Field(default=1, ge=1, le=64)
    """Groups (each of group_size episodes) this replica runs at once per run."""
    tool_timeout_s: float = Field(default=10.0, gt=0)
    """Deadline for one tool call, terminal commands included."""
    torch_threads: int = Field(default=1, ge=1)
    max_context: int = Field(default=2048, ge=256)
    """Tokens per episode; an episode that reaches it ends with finish_reason="context"."""
