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
    max_sequences: int = Field(default=64, ge=1, le=1024)
    """Episodes one run's engine decodes together (KV cache slots, allocated as they are needed); more
    wait for a slot."""
    prefill_chunk: int = Field(default=256, ge=16)
    """Tokens of one sequence's prefill per engine step, so a long observation never stalls the others."""
