"""Fewer pages written per submission: a commit writes every page a transaction changed, whole, to the log.

- Nonces keyed by (ts, signer, nonce), without a rowid on SQLite, instead of (signer, nonce) with an index on ts.
  A request's signed timestamp is close to now, so a new record is stored next to the previous ones: a commit
  writes one page for a batch of them, not a page picked at random (and the index on ts besides) for each. Pruning
  by time cuts the oldest end of the key. A replayed request carries the timestamp it was signed with, so its
  record is found as before. The records are copied over.
- One index of a node's groups, (node_id, status, held, id), instead of (node_id, status) and (node_id, held, id):
  every query of a node's groups names its status, and each new group was written into two pages picked by its
  node instead of one.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "nonces_by_time",
        sa.Column("ts", sa.Double, primary_key=True, autoincrement=False),
        sa.Column("signer", sa.Text, primary_key=True),
        sa.Column("nonce", sa.Text, primary_key=True),
        sqlite_with_rowid=False,
    )
    op.execute("INSERT INTO nonces_by_time (ts, signer, nonce) SELECT ts, signer, nonce FROM nonces")
    op.drop_index("nonces_ts", table_name="nonces")
    op.drop_table("nonces")
    op.rename_table("nonces_by_time", "nonces")
    if op.get_bind().dialect.name == "postgresql":  # its primary key's name follows the table's first name
        op.execute("ALTER INDEX nonces_by_time_pkey RENAME TO nonces_pkey")
    op.drop_index("rollout_groups_held", table_name="rollout_groups")
    op.drop_index("rollout_groups_node", table_name="rollout_groups")
    op.create_index("rollout_groups_node", "rollout_groups", ["node_id", "status", "held", "id"])


def downgrade() -> None:
    op.drop_index("rollout_groups_node", table_name="rollout_groups")
    op.create_index("rollout_groups_node", "rollout_groups", ["node_id", "status"])
    op.create_index("rollout_groups_held", "rollout_groups", ["node_id", "held", "id"])
    op.create_table(
        "nonces_by_signer",
        sa.Column("signer", sa.Text, primary_key=True),
        sa.Column("nonce", sa.Text, primary_key=True),
        sa.Column("ts", sa.Double, nullable=False),
    )
    op.execute("INSERT INTO nonces_by_signer (signer, nonce, ts) SELECT signer, nonce, MAX(ts) FROM nonces "
               "GROUP BY signer, nonce")
    op.drop_table("nonces")
    op.rename_table("nonces_by_signer", "nonces")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER INDEX nonces_by_signer_pkey RENAME TO nonces_pkey")
    op.create_index("nonces_ts", "nonces", ["ts"])
