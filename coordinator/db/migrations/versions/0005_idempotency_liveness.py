"""Idempotency keys (the stored answer of every request that carried one) and node liveness (`gone_since`).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "idempotency_keys",
        sa.Column("signer", sa.Text, primary_key=True),
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("digest", sa.Text, nullable=False),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
    )
    op.create_index("idempotency_keys_created", "idempotency_keys", ["created_at"])
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("gone_since", sa.Double))
    op.create_index("nodes_last_seen", "nodes", ["last_seen"])


def downgrade() -> None:
    op.drop_index("nodes_last_seen", "nodes")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("gone_since")
    op.drop_index("idempotency_keys_created", "idempotency_keys")
    op.drop_table("idempotency_keys")
