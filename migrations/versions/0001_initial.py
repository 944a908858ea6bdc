"""Initial schema: runs, steps, trajectories and their gradings, checkpoints, the task index.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp(name: str, *, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _run_id() -> sa.Column:
    return sa.Column(
        "run_id", sa.String(64), sa.ForeignKey("runs.run_id", ondelete="CASCADE"), nullable=False
    )


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        _timestamp("finished_at", nullable=True),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_runs")),
    )
    op.create_index(op.f("ix_runs_created_at"), "runs", ["created_at"])

    op.create_table(
        "steps",
        _run_id(),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("trajectory_ids", sa.JSON(), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("run_id", "step", name=op.f("pk_steps")),
    )

    op.create_table(
        "step_trajectories",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("trajectory_id", sa.String(128), nullable=False),
        sa.Column("uses", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id", "step"],
            ["steps.run_id", "steps.step"],
            name=op.f("fk_step_trajectories_run_id_steps"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "step", "trajectory_id", name=op.f("pk_step_trajectories")),
    )
    op.create_index(op.f("ix_step_trajectories_trajectory_id"), "step_trajectories", ["trajectory_id"])

    op.create_table(
        "trajectories",
        sa.Column("trajectory_id", sa.String(128), nullable=False),
        _run_id(),
        sa.Column("group_id", sa.String(128), nullable=False),
        sa.Column("task_id", sa.String(200), nullable=False),
        sa.Column("taskset", sa.String(100), nullable=False),
        sa.Column("reward", sa.Float(), nullable=False),
        sa.Column("tests_passed", sa.Integer(), nullable=False),
        sa.Column("tests_total", sa.Integer(), nullable=False),
        sa.Column("reward_components", sa.JSON(), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("version_min", sa.Integer(), nullable=False),
        sa.Column("version_max", sa.Integer(), nullable=False),
        sa.Column("tool_calls", sa.JSON(), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("graded_count", sa.Integer(), nullable=False),
        _timestamp("graded_at"),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("trajectory_id", name=op.f("pk_trajectories")),
    )
    op.create_index("ix_trajectories_run_created", "trajectories", ["run_id", "created_at", "trajectory_id"])
    op.create_index(op.f("ix_trajectories_task_id"), "trajectories", ["task_id"])

    op.create_table(
        "gradings",
        sa.Column(
            "trajectory_id",
            sa.String(128),
            sa.ForeignKey("trajectories.trajectory_id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("grading_key", sa.String(200), nullable=False),
        sa.Column("reward", sa.Float(), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("trajectory_id", "grading_key", name=op.f("pk_gradings")),
    )

    op.create_table(
        "checkpoints",
        _run_id(),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("manifest_uri", sa.String(500), nullable=False),
        sa.Column("num_tensors", sa.Integer(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("run_id", "version", name=op.f("pk_checkpoints")),
    )

    op.create_table(
        "tasks",
        sa.Column("task_id", sa.String(200), nullable=False),
        sa.Column("taskset", sa.String(100), nullable=False),
        sa.Column("difficulty", sa.Integer(), nullable=False),
        sa.Column("family", sa.String(100), nullable=False),
        sa.Column("statement", sa.Text(), nullable=False),
        sa.Column("snapshot", sa.JSON(), nullable=False),
        sa.Column("hidden_tests", sa.JSON(), nullable=False),
        sa.Column("test_command", sa.JSON(), nullable=False),
        sa.Column("reference_patch", sa.Text(), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("task_id", name=op.f("pk_tasks")),
    )
    op.create_index(op.f("ix_tasks_taskset"), "tasks", ["taskset"])


def downgrade() -> None:
    for table in ("tasks", "checkpoints", "gradings", "trajectories", "step_trajectories", "steps", "runs"):
        op.drop_table(table)
