"""What the REST API accepts and returns (pydantic, so the OpenAPI document describes it)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from crucible.contracts.runconfig import RunConfig

T = TypeVar("T")


class RunCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    name: str = Field(min_length=1, max_length=200)
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


class TrajectoryDetail(TrajectorySummary):
    segments: list[Segment]
    tool_calls: list[ToolCallOut]
    reward_detail: RewardOut
    final_diff: str
    rollout_replica: str
    grader_replica: str
    started_at: float
    finished_at: float
    trained_steps: list[int]
