"""What the REST API accepts and returns (pydantic, so the OpenAPI document describes it)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from crucible.contracts.inputs import NONBLANK, Input
from crucible.contracts.runconfig import RunConfig

MAX_VERSION = 2**31 - 1
"""The largest weight version (or step) the database's 32-bit integer columns hold."""

T = TypeVar("T")


class RunCreate(Input):
    model_config = ConfigDict(str_strip_whitespace=True)

    name: str = Field(min_length=1, max_length=200, pattern=NONBLANK)
    config: RunConfig = Field(default_factory=RunConfig)


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class RunOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    run_id: str
    name: str
    status: str
    config: dict[str, Any]
    error: str | None
    warm_start: dict[str, Any] | None = Field(
        default=None,
        description="The supervised warm start, once trained: demonstrations, skipped (by reason), steps, "
        "tokens, losses (every loss_every-th step), seconds.",
    )
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class StepOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    step: int
    version: int
    metrics: dict[str, Any]
    trajectory_ids: list[str]
    created_at: datetime


class TaskRecordOut(BaseModel):
    """A run's record on one task: its graded training episodes, overall and over the most recent ones
    (`recent_attempts`, at most crucible.db.task_records.RECENT), whose pass rate learnable sampling
    weighs the task by."""

    model_config = ConfigDict(from_attributes=True)

    task_id: str
    attempts: int
    resolved: int
    recent_attempts: int
    recent_resolved: int
    pass_rate: float
    last_graded_at: datetime


class MetricPoint(BaseModel):
    step: int
    version: int
    value: float


class MetricsOut(BaseModel):
    run_id: str
    series: dict[str, list[MetricPoint]] = Field(description="Per metric name, one point per step.")


class CheckpointOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    version: int
    step: int
    manifest_uri: str
    num_tensors: int
    size_bytes: int
    """Bytes of the version's shards in the object store."""
    kind: str
    """full, or delta: rebuilt from the full version `base_version` (a replica needs both)."""
    base_version: int | None
    raw_bytes: int
    """Bytes of the weights it reproduces (0 for versions recorded before deltas)."""
    created_at: datetime


class TrajectorySummary(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    trajectory_id: str
    run_id: str
    group_id: str
    task_id: str
    taskset: str
    reward: float
    tests_passed: int
    tests_total: int
    reward_components: dict[str, float]
    resolved: bool
    eval_id: str | None = Field(description="The evaluation this episode belongs to; null for training.")
    eval_sample: int = Field(description="Within an evaluation: 0 greedy, 1..k sampled.")
    finish_reason: str
    num_tokens: int
    version_min: int
    version_max: int
    num_tool_calls: int
    graded_count: int = Field(description="Distinct gradings received; more than 1 means graded twice.")
    trained_count: int = Field(description="Optimizer steps that used it; more than 1 means trained twice.")
    trained_step: int | None = Field(description="The first step that trained on it.")
    graded_at: datetime
    created_at: datetime


class Segment(BaseModel):
    """A stretch of the transcript produced by one side (agent or environment) under one policy version."""

    role: Literal["agent", "environment"]
    version: int
    token_start: int
    token_end: int
    text: str


class ToolCallOut(BaseModel):
    index: int
    name: str
    arguments: str
    ok: bool
    output: str
    duration_s: float
    token_start: int
    token_end: int
    policy_version: int


class TestResultOut(BaseModel):
    nodeid: str
    outcome: str


class RewardOut(BaseModel):
    total: float
    tests_passed: int
    tests_total: int
    components: dict[str, float]
    tests: list[TestResultOut]
    note: str
    resolved: bool
    fail_to_pass: list[int] = Field(description="[passed, total] of the task's FAIL_TO_PASS tests.")
    pass_to_pass: list[int] = Field(description="[passed, total] of its PASS_TO_PASS tests.")
    quality: dict[str, float]


class TokenUsageOut(BaseModel):
    """Where an episode's tokens went; the parts add up to num_tokens."""

    system: int = Field(description="The prompt's shared part: system prompt and tool definitions.")
    task: int = Field(description="The rest of each context's prompt: the task (and a summary).")
    observations: int = Field(description="Tool results and the template's tokens between turns.")
    actions: int = Field(description="The policy's tool calls and summaries.")


class TrajectoryDetail(TrajectorySummary):
    segments: list[Segment]
    tool_calls: list[ToolCallOut]
    token_usage: TokenUsageOut | None = Field(description="null for episodes recorded before it was.")
    reward_detail: RewardOut
    final_diff: str
    rollout_replica: str
    grader_replica: str
    started_at: float
    finished_at: float
    trained_steps: list[int]


class EvalCreate(Input):
    """An evaluation of one published weight version; unset fields come from the run's `eval` section."""

    model_config = ConfigDict(str_strip_whitespace=True)

    run_id: str = Field(min_length=1, max_length=64, pattern=NONBLANK)
    version: int | None = Field(
        default=None, ge=0, le=MAX_VERSION, description="Default: the run's latest published version."
    )
    taskset: str | None = Field(default=None, min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_-]+$")
    split: Literal["train", "validation", "test"] | None = None
    samples: int | None = Field(default=None, ge=0, le=64, description="Sampled episodes per task (pass@k).")
    max_tasks: int | None = Field(default=None, ge=1, le=10_000)


class Rate(BaseModel):
    """A proportion with its 95% Wilson score interval."""

    value: float | None = Field(description="null until something was graded")
    ci_low: float | None
    ci_high: float | None
    n: int = Field(description="How many outcomes it is over.")


class EvalTaskOut(BaseModel):
    task_id: str
    greedy_resolved: bool | None = Field(description="null until the greedy episode is graded")
    samples_resolved: int
    samples_graded: int


class EvalOut(BaseModel):
    eval_id: str
    run_id: str
    version: int
    taskset: str
    split: str
    samples: int
    max_tasks: int
    source: str
    status: Literal["requested", "running", "finished", "failed"]
    error: str | None
    tasks: int | None
    expected: int | None = Field(description="Episodes that will be graded (tasks x (1 + samples)).")
    graded: int
    failed_episodes: int
    pass_at_1: Rate = Field(description="Greedy episode resolved, per task.")
    pass_at_k: Rate = Field(description="At least one of the k sampled episodes resolved, per task.")
    resolved_rate: Rate = Field(description="Every graded episode, greedy and sampled.")
    quality: dict[str, float] = Field(description="Means over resolved episodes (services.grader.quality).")
    per_task: list[EvalTaskOut]
    created_at: datetime
    updated_at: datetime


class KeyCreate(Input):
    model_config = ConfigDict(str_strip_whitespace=True)

    scope: Literal["read", "write", "admin"] = Field(
        description="read: every GET; write: also start and cancel runs and request evaluations; admin: "
        "also manage keys."
    )
    name: str = Field(min_length=1, max_length=200, pattern=NONBLANK, description="Who or what holds it.")


class KeyOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    key_id: str
    name: str
    scope: str
    created_at: datetime
    revoked_at: datetime | None


class KeyCreated(KeyOut):
    token: str = Field(description="The bearer token; shown this once, it cannot be recovered.")
