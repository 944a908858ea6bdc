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
    """Tokens prefilled per engine step (a chunk of one sequence, or of several as long), so a long
    observation never stalls the others."""
    episodes_host: str = "127.0.0.1"
    """Where the episodes endpoint that agent harnesses drive (services.rollout.harness) listens."""
    episodes_port: int = Field(default=0, ge=0, le=65535)
    """Its port (0: a free one)."""
    harness_command: list[str] = Field(default_factory=list)
    """The agent harness a run with agent.driver = "harness" gets, started once per episode with
    OPENAI_BASE_URL and CRUCIBLE_EPISODE_URL set; empty: Crucible's reference harness
    (python -m crucible.agent.harness). An operator's choice, never a run's."""
    harness_timeout_s: float = Field(default=900.0, gt=0)
    """An episode's harness still running after this is killed; the episode ends with "timeout"."""
