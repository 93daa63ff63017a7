"""The contribution ledger: signed receipts (one per accepted group) and accepted groups and tokens per node and
policy version, with the counter that numbers receipts. Groups accepted before this migration get their receipts
when the coordinator next starts (`coordinator.ledger.Ledger.backfill`: signing needs its key).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_AutoId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "receipts",
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("group_id", sa.BigInteger, sa.ForeignKey("rollout_groups.id"), nullable=False, unique=True),
        sa.Column("node_id", sa.Text, sa.ForeignKey("nodes.id"), nullable=False),
        sa.Column("policy_version", sa.BigInteger, nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
        sa.Column("accepted_at", sa.Double, nullable=False),
        sa.Column("body", sa.Text, nullable=False),
    )
    op.create_index("receipts_node", "receipts", ["node_id", "seq"])
    op.create_table(
        "ledger",
        sa.Column("id", _AutoId, primary_key=True, autoincrement=True),
        sa.Column("node_id", sa.Text, sa.ForeignKey("nodes.id"), nullable=False),
        sa.Column("policy_version", sa.BigInteger, nullable=False),
        sa.Column("groups", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("last_accepted_at", sa.Double, nullable=False),
        sa.UniqueConstraint("node_id", "policy_version"),
        sqlite_autoincrement=True,
    )
    op.get_bind().execute(sa.text("INSERT INTO kv (key, value) SELECT 'receipt_seq', 0 "
                                  "WHERE NOT EXISTS (SELECT 1 FROM kv WHERE key = 'receipt_seq')"))


def downgrade() -> None:
    op.get_bind().execute(sa.text("DELETE FROM kv WHERE key = 'receipt_seq'"))
    op.drop_table("ledger")
    op.drop_index("receipts_node", "receipts")
    op.drop_table("receipts")
