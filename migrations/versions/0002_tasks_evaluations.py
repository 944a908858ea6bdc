"""Tasks with SWE-bench semantics and splits; evaluations and their episodes.

tasks: split, source, repo, fail_to_pass, pass_to_pass. trajectories: resolved, eval_id, eval_sample, quality.
A new table `evaluations`. Existing tasks become train tasks without test lists: the catalog
re-verifies and rewrites its generated tasks at start (their rows no longer match).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("split", sa.String(16), nullable=False, server_default="train"))
        batch.add_column(sa.Column("source", sa.String(32), nullable=False, server_default="generated"))
        batch.add_column(sa.Column("repo", sa.String(200), nullable=False, server_default=""))
        batch.add_column(sa.Column("fail_to_pass", sa.JSON(), nullable=False, server_default="[]"))
        batch.add_column(sa.Column("pass_to_pass", sa.JSON(), nullable=False, server_default="[]"))
    with op.batch_alter_table("trajectories") as batch:
        batch.add_column(sa.Column("resolved", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("eval_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("eval_sample", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("quality", sa.JSON(), nullable=False, server_default="{}"))
        batch.create_index(batch.f("ix_trajectories_eval_id"), ["eval_id"])
    op.create_table(
        "evaluations",
        sa.Column("eval_id", sa.String(64), nullable=False),
        sa.Column("run_id", sa.String(64), sa.ForeignKey("runs.run_id", ondelete="CASCADE"), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("taskset", sa.String(100), nullable=False),
        sa.Column("split", sa.String(16), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("max_tasks", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("tasks", sa.Integer(), nullable=True),
        sa.Column("expected", sa.Integer(), nullable=True),
        sa.Column("failed_episodes", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("eval_id", name=op.f("pk_evaluations")),
    )
    op.create_index(op.f("ix_evaluations_created_at"), "evaluations", ["created_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_evaluations_created_at"), table_name="evaluations")
    op.drop_table("evaluations")
    with op.batch_alter_table("trajectories") as batch:
        batch.drop_index(batch.f("ix_trajectories_eval_id"))
        for column in ("quality", "eval_sample", "eval_id", "resolved"):
            batch.drop_column(column)
    with op.batch_alter_table("tasks") as batch:
        for column in ("pass_to_pass", "fail_to_pass", "repo", "source", "split"):
            batch.drop_column(column)
