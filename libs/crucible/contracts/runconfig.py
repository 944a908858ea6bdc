"""The run configuration: everything that defines a run, nested by concern, in one definition.

The REST API validates it (its OpenAPI schema is this model's), RUNS carries it to the trainer and the
rollouts, and the command line loads it from TOML with `section.field=value` overrides:

    [schedule]
    max_steps = 6

    crucible demo --config run.toml --set optim.learning_rate=1e-4

Configs written before the sections existed (flat `group_size`, `model_preset`, ...) are refused with
a message that names each field's new place.
"""

from __future__ import annotations

import tomllib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from crucible.model.config import PRESETS


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class TasksSection(Section):
    taskset: str = Field(default="pybugs", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_-]+$")
    """The catalog's task set that episodes are sampled from."""
    difficulties: list[Annotated[int, Field(ge=0, le=100)]] = Field(default=[1, 2], min_length=1, max_length=100)
    """Difficulty levels to sample, uniformly."""


class ModelSection(Section):
    preset: str = Field(default="tiny", min_length=1, max_length=100)
    """Named model configuration the run starts from (randomly initialised from `seed`)."""
    precision: Literal["bf16", "mxfp8"] = "bf16"
    """Training and inference precision of the linear layers."""

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value not in PRESETS:
            raise ValueError(f"unknown model preset {value!r}; known: {', '.join(PRESETS)}")
        return value


class AgentSection(Section):
    max_turns: int = Field(default=3, ge=1, le=256)
    """Tool calls an episode may make before it ends."""
    max_action_tokens: int = Field(default=40, ge=1, le=4096)
    """Tokens the policy may sample for one action."""
    max_observation_bytes: int = Field(default=200, ge=16, le=65536)
    """Bytes of a tool's output that the policy sees (the rest is cut)."""
    temperature: float = Field(default=1.0, gt=0, le=10)
    """Sampling temperature; the trainer computes its logprobs at the same temperature."""


class OptimSection(Section):
    learning_rate: float = Field(default=1e-3, gt=0, le=1)
    """AdamW learning rate."""
    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """PPO clip range of the importance ratio against the behaviour policy."""


class ScheduleSection(Section):
    max_steps: int = Field(default=6, ge=1)
    """Optimizer steps of the run."""
    group_size: int = Field(default=4, ge=1, le=1024)
    """Episodes per task; advantages are relative to the group."""
    groups_per_step: int = Field(default=2, ge=1, le=1024)
    """Groups in one optimizer step."""
    publish_every: int = Field(default=2, ge=1)
    """A new weight version every this many optimizer steps."""
    max_staleness: int = Field(default=2, ge=0)
    """Versions a sampled token may lag the trainer's current version; older tokens are not trained on
    and rollouts admit no work that would break the bound."""


class RunConfig(Section):
    """Everything that defines a run."""

    seed: int = Field(default=0, ge=0)
    """Seed of the model's initialisation, task sampling and the episodes' sampling."""
    tasks: TasksSection = Field(default_factory=TasksSection)
    model: ModelSection = Field(default_factory=ModelSection)
    agent: AgentSection = Field(default_factory=AgentSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)

    @model_validator(mode="before")
    @classmethod
    def _no_flat_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = [f"`{name}` is now `{MOVED[name]}`" for name in data if name in MOVED]
            if moved:
                raise ValueError("run config fields moved into sections: " + "; ".join(moved))
        return data

    @classmethod
    def from_toml(cls, text: str, *, overrides: list[str] = ()) -> RunConfig:
        """A config from TOML text, then `section.field=value` overrides (values in TOML syntax; a bare
        word is a string). Raises ValueError (pydantic's ValidationError is one) naming what is wrong."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"not valid TOML: {exc}") from None
        for override in overrides:
            apply_override(data, override)
        return cls.model_validate(data)


MOVED = {
    **{name: f"tasks.{name}" for name in TasksSection.model_fields},
    "model_preset": "model.preset",
    "precision": "model.precision",
    **{name: f"agent.{name}" for name in AgentSection.model_fields},
    **{name: f"optim.{name}" for name in OptimSection.model_fields},
    **{name: f"schedule.{name}" for name in ScheduleSection.model_fields},
}
"""Flat field names of the first run config, and where each lives now."""


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in nested `data`; the value is parsed as TOML, or taken as a string."""
    path, sep, raw = override.partition("=")
    keys = path.strip().split(".")
    if not sep or not all(keys):
        raise ValueError(f"override {override!r} is not of the form section.field=value")
    try:
        value = tomllib.loads(f"value = {raw.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {override!r}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value
