from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from crucible.settings import CommonSettings


class Settings(CommonSettings):
    max_episodes: int = Field(default=32, ge=1, le=1024)
    """Episodes this replica runs at once, over its runs and evaluations: each holds a sandbox session
    (keep it within the sandbox replicas' `max_sessions`) and a KV slot. A run admits a group whenever
    its episodes fit, so a step's groups are admitted together and decode in one batch. It also bounds
    each engine's KV cache (allocated as needed, doubling): max_episodes x max_context positions, 6 GB
    for SmolLM2 at 32 x 4096 (fp32)."""
    max_failed_groups: int = Field(default=10, ge=1)
    """Groups of one run that may produce nothing in a row (outages aside) before the run is failed
    with the reason."""
    tool_timeout_s: float = Field(default=10.0, gt=0)
    """Deadline for one tool call, terminal commands included."""
    torch_threads: int = Field(default=1, ge=1)
    max_context: int = Field(default=2048, ge=256)
    """Tokens per episode; an episode that reaches it ends with finish_reason="context"."""
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
    engine_url: str = ""
    """An external inference server (vLLM, SGLang, or `crucible serve --weights-dir`) that samples this
    replica's episodes instead of its in-process engine (services.rollout.external); empty: in process.
    For runs of a pretrained model with its own chat template; evaluations stay in process."""
    engine_kind: Literal["vllm", "sglang"] = "sglang"
    """The server's dialect: vLLM's completions and reload, or SGLang's (which `crucible serve` speaks)."""
    engine_weights_dir: Path | None = None
    """Where each announced version is written for the external server to load: a directory it sees at
    the same path (a shared volume)."""
    engine_timeout_s: float = Field(default=300.0, gt=0)
    """Deadline for one request to the external server (a reload included)."""

    @model_validator(mode="after")
    def _external_engine(self) -> "Settings":
        if self.engine_url and not self.engine_url.startswith(("http://", "https://")):
            raise ValueError(f"engine_url must be an http(s) URL, got {self.engine_url!r}")
        if self.engine_url and self.engine_weights_dir is None:
            raise ValueError("engine_url needs engine_weights_dir: where the server loads each version from")
        return self
