"""Weight deltas: `checkpoints.kind` says whether a version is a full snapshot or a delta against the full
version `base_version`; `raw_bytes` is the size of the weights it reproduces (`size_bytes`, what its
shards take, is far smaller for a delta). Rows from before deltas are full snapshots of unknown raw size.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("kind", sa.String(8), nullable=False, server_default="full"))
        batch.add_column(sa.Column("base_version", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("raw_bytes", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("raw_bytes")
        batch.drop_column("base_version")
        batch.drop_column("kind")
