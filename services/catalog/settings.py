"""Settings of the catalog service (env prefix CRUCIBLE_)."""

from __future__ import annotations

from pydantic import Field, field_validator

from crucible.settings import CommonSettings


class Settings(CommonSettings):
    taskset: str = Field(default="pybugs", pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
    """Name of the built-in, generated task set this service publishes at start."""
    taskset_seed: int = 0
    """Seed of the generator: the same seed always gives the same tasks."""
    tasks_per_difficulty: int = Field(default=5, ge=0, le=1000)
    """Tasks generated at each difficulty; each one is verified (pytest twice) before it is served. One
    in five goes to the test split and one in five to validation (services.catalog.splits)."""
    difficulties: list[int] = Field(default_factory=lambda: [1, 2, 3])
    verify_workers: int = Field(default=2, ge=1, le=64)
    """Tasks verified at once at start-up."""
    verify_timeout_s: float = Field(default=60.0, gt=0)
    """Limit of one pytest run while verifying a task."""
    max_sample: int = Field(default=1024, ge=1)
    """Most tasks one `catalog.sample` request may ask for."""

    @field_validator("difficulties")
    @classmethod
    def _known_levels(cls, value: list[int]) -> list[int]:
        if not value or any(level not in (1, 2, 3) for level in value):
            raise ValueError("difficulties must be a non-empty list of 1, 2 and 3")
        return sorted(set(value))
