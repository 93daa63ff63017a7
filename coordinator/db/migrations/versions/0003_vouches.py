"""Held groups count the vouching full checks they have had (`protocol.quarantine`: a held group is released after
`release_passes` of them). Groups held before this revision start at 0.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rollout_groups") as batch:
        batch.add_column(sa.Column("vouches", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("rollout_groups") as batch:
        batch.drop_column("vouches")
