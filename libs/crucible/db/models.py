"""The relational schema: run history (api) and the task index (catalog).

Portable column types only (JSON, not JSONB), so one set of migrations runs on PostgreSQL and SQLite.
Schema changes go through Alembic (migrations/versions/); these classes must match the newest revision.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored in UTC and always read back timezone-aware (SQLite keeps no offset)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    @property
    def python_type(self) -> type[datetime]:
        return datetime

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime; Crucible stores timezone-aware UTC timestamps")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _run_id_column(*, primary_key: bool = False) -> Mapped[str]:
    return mapped_column(String(64), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=primary_key)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
        list[Any]: JSON(),
    }


class Run(Base):
    __tablename__ = "runs"

    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default="created")
    config: Mapped[dict[str, Any]]
    error: Mapped[str | None] = mapped_column(Text)
    warm_start: Mapped[dict[str, Any] | None]
    """The trainer's `sft` event (crucible.contracts.events.WarmStartReport), once the warm start trained."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None]
    objects_released_at: Mapped[datetime | None]
    """When the run's trajectory objects were deleted from the object store (services.api.cleanup)."""


class Step(Base):
    """One optimizer step: its metrics and the trajectories it trained on."""

    __tablename__ = "steps"

    run_id: Mapped[str] = _run_id_column(primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]]
    trajectory_ids: Mapped[list[Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class StepTrajectory(Base):
    """Which step trained on which trajectory, and how often. Counting these rows (rather than keeping a
    counter on the trajectory) stays correct when a step arrives before the trajectory it lists."""

    __tablename__ = "step_trajectories"
    __table_args__ = (
        ForeignKeyConstraint(["run_id", "step"], ["steps.run_id", "steps.step"], ondelete="CASCADE"),
    )

    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    trajectory_id: Mapped[str] = mapped_column(String(128), primary_key=True, index=True)
    uses: Mapped[int] = mapped_column(Integer, default=1)


class Trajectory(Base):
    """A graded trajectory. `payload` is the GradedTrajectory exactly as it came off the bus (msgpack), so
    nothing is lost and the transcript is rendered on read; the columns hold what lists filter on."""

    __tablename__ = "trajectories"
    __table_args__ = (Index("ix_trajectories_run_created", "run_id", "created_at", "trajectory_id"),)

    trajectory_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    run_id: Mapped[str] = _run_id_column()
    group_id: Mapped[str] = mapped_column(String(128))
    task_id: Mapped[str] = mapped_column(String(200), index=True)
    taskset: Mapped[str] = mapped_column(String(100))
    reward: Mapped[float] = mapped_column(Float)
    tests_passed: Mapped[int] = mapped_column(Integer)
    tests_total: Mapped[int] = mapped_column(Integer)
    reward_components: Mapped[dict[str, Any]]
    resolved: Mapped[bool] = mapped_column(Boolean, default=False)
    eval_id: Mapped[str | None] = mapped_column(String(64), index=True)
    """Set for an evaluation's episodes (never trained on); null for training episodes."""
    eval_sample: Mapped[int] = mapped_column(Integer, default=0)
    quality: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """An evaluated, resolved change's quality measures (services.grader.quality); empty otherwise."""
    finish_reason: Mapped[str] = mapped_column(String(32))
    num_tokens: Mapped[int] = mapped_column(Integer)
    version_min: Mapped[int] = mapped_column(Integer)
    version_max: Mapped[int] = mapped_column(Integer)
    tool_calls: Mapped[list[Any]]
    payload: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)
    graded_count: Mapped[int] = mapped_column(Integer, default=1)
    graded_at: Mapped[datetime]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Grading(Base):
    """One distinct grading of a trajectory. A redelivery of the same message adds no row; a second,
    different grading of the same trajectory does, and bumps the trajectory's `graded_count`."""

    __tablename__ = "gradings"

    trajectory_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("trajectories.trajectory_id", ondelete="CASCADE"), primary_key=True
    )
    grading_key: Mapped[str] = mapped_column(String(200), primary_key=True)
    reward: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    run_id: Mapped[str] = _run_id_column(primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer)
    manifest_uri: Mapped[str] = mapped_column(String(500))
    num_tensors: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    """What the version's shards take in the object store."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    kind: Mapped[str] = mapped_column(String(8), default="full", server_default="full")
    """full, or delta: its shards rebuild the weights from those of the full version `base_version`."""
    base_version: Mapped[int | None] = mapped_column(Integer)
    raw_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """The size of the weights it reproduces (0: recorded before deltas existed)."""


class Evaluation(Base):
    """One evaluation of a weight version on a held-out split. Its episodes are the trajectories with
    this `eval_id`; its scores are computed from them when read."""

    __tablename__ = "evaluations"

    eval_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[str] = _run_id_column()
    version: Mapped[int] = mapped_column(Integer)
    taskset: Mapped[str] = mapped_column(String(100))
    split: Mapped[str] = mapped_column(String(16))
    samples: Mapped[int] = mapped_column(Integer)
    max_tasks: Mapped[int] = mapped_column(Integer)
    source: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default="requested")
    """requested, running (its episodes are known), failed; finished is when every episode is graded."""
    tasks: Mapped[int | None] = mapped_column(Integer)
    expected: Mapped[int | None] = mapped_column(Integer)
    failed_episodes: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Task(Base):
    """The catalog's index of one task; its files live in the object store (`snapshot`, `hidden_tests`
    are object references {uri, sha256, size})."""

    __tablename__ = "tasks"

    task_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    taskset: Mapped[str] = mapped_column(String(100), index=True)
    split: Mapped[str] = mapped_column(String(16), default="train")
    """train, validation or test: fixed when the task set is made (see services.catalog.splits)."""
    source: Mapped[str] = mapped_column(String(32), default="generated")
    """generated, swebench (imported) or synthesized."""
    repo: Mapped[str] = mapped_column(String(200), default="")
    """The repository an imported or synthesized task comes from."""
    difficulty: Mapped[int] = mapped_column(Integer)
    family: Mapped[str] = mapped_column(String(100))
    statement: Mapped[str] = mapped_column(Text)
    snapshot: Mapped[dict[str, Any]]
    hidden_tests: Mapped[dict[str, Any]]
    test_command: Mapped[list[Any]]
    reference_patch: Mapped[str] = mapped_column(Text)
    fail_to_pass: Mapped[list[Any]] = mapped_column(JSON, default=list)
    pass_to_pass: Mapped[list[Any]] = mapped_column(JSON, default=list)
    probes: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """Generated tasks: node id -> {value, error}, what each hidden probe test must give (crucible.probes)."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    """A REST API key (crucible.apikeys): only the sha256 of its secret is kept."""

    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    scope: Mapped[str] = mapped_column(String(16))
    """read, write (read and start or cancel runs, request evaluations) or admin (also manage keys)."""
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]
