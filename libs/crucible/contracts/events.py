"""Run history events: one typed payload per kind, built by the producers and decoded by the api.

An `Event` goes to `events.<run>.<kind>` on the EVENTS stream. Its `msg_id` makes a republished event
(after a crash) a duplicate that JetStream drops, so each status, step and checkpoint is stored once.
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec

from crucible.contracts import subjects
from crucible.contracts.messages import EvalRequest, Message

RunStatusName = Literal["created", "running", "finished", "failed", "cancelled"]
TERMINAL_STATUSES = ("finished", "failed", "cancelled")


class EventData(msgspec.Struct, kw_only=True, tag_field="kind"):
    """Base of every event payload; the tag is the event's kind."""

    @property
    def kind(self) -> str:
        return str(self.__struct_config__.tag)


class RunStatus(EventData, tag="run.status"):
    status: RunStatusName
    error: str | None = None


class StepReport(EventData, tag="step"):
    """An optimizer step: the version the batch trained against, what it trained on, its metrics."""

    step: int
    version: int
    trajectory_ids: list[str] = msgspec.field(default_factory=list)
    dropped_stale_ids: list[str] = msgspec.field(default_factory=list)
    """Trajectories left out because their tokens were too stale."""
    dropped_alone_ids: list[str] = msgspec.field(default_factory=list)
    """Trajectories left out because too few members of their group remained to compare against."""
    metrics: dict[str, float] = msgspec.field(default_factory=dict)


class WarmStartReport(EventData, tag="sft"):
    """A run's supervised warm start, once it has trained (run config `sft`): how many demonstrations it
    rendered and left out (by reason), and its loss, every `loss_every`-th step."""

    demonstrations: int
    skipped: dict[str, int] = msgspec.field(default_factory=dict)
    steps: int = 0
    tokens: int = 0
    """Policy tokens trained on, all steps together."""
    losses: list[float] = msgspec.field(default_factory=list)
    loss_every: int = 1
    seconds: float = 0.0


class CheckpointPublished(EventData, tag="checkpoint"):
    version: int
    step: int
    manifest_uri: str
    num_tensors: int = 0
    size_bytes: int = 0  # what the version's shards take in the object store
    weights: str = "full"  # or "delta": its shards rebuild the weights from those of `base_version`
    base_version: int | None = None
    raw_bytes: int = 0  # the weights it reproduces (0 from a checkpoints service before deltas)


class RolloutReport(EventData, tag="rollout"):
    """A rollout replica's progress on a run, for live observers (the api does not store it)."""

    replica: str
    version: int
    episodes: int
    tokens: int
    tokens_per_s: float
    episodes_per_min: float


class EvalReport(EventData, tag="eval"):
    """Where an evaluation stands: `requested` (by the run's schedule), `running` once a rollout replica
    knows its episodes (`expected` trajectories), `done` when every episode was published or failed
    (`failed_episodes` of them never will be graded), `failed` when it cannot run at all."""

    request: EvalRequest
    status: Literal["requested", "running", "done", "failed"]
    tasks: int = 0
    expected: int = 0
    failed_episodes: int = 0
    error: str = ""


EventPayload = RunStatus | StepReport | CheckpointPublished | RolloutReport | EvalReport | WarmStartReport


class Event(Message, tag="event.v2"):
    run_id: str
    ts: float
    data: EventPayload
    source: str = ""

    @classmethod
    def now(cls, run_id: str, data: EventPayload, *, source: str) -> Event:
        return cls(run_id=run_id, ts=time.time(), data=data, source=source)

    @property
    def kind(self) -> str:
        return self.data.kind

    @property
    def subject(self) -> str:
        return subjects.events(self.run_id, self.kind)

    @property
    def msg_id(self) -> str | None:
        """The de-duplication id: one status change, step or checkpoint per run; progress reports none."""
        data = self.data
        if isinstance(data, RunStatus):
            return f"{self.run_id}/status/{data.status}"
        if isinstance(data, StepReport):
            return f"{self.run_id}/step/{data.step}"
        if isinstance(data, CheckpointPublished):
            return f"{self.run_id}/checkpoint/{data.version}"
        if isinstance(data, EvalReport):
            return f"{self.run_id}/eval/{data.request.eval_id}/{data.status}"
        return None
