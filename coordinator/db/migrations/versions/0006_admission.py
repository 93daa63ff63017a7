"""Admission: per-node lease counters, signed leases, the queue of prompts to lease again; stateless challenges.

- nodes.prompts_leased / prompts_abandoned: what a node's lease allowance is judged on (`coordinator.admission`),
  and nodes.source, the address it registered from (unproven identities of one source share an allowance; nodes
  registered before this revision share the source '' until they register again or earn their record);
- leases.signature / digests: the coordinator's signature of each lease and the digests of its prompts, so a
  verifier judges a group against exactly what was signed (leases from before this revision have neither);
- prompt_queue: prompts leased and not used, leased again to other identities;
- challenges: dropped; a registration challenge is a MAC under the run's secret now, and nothing is stored.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("prompts_leased", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("prompts_abandoned", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("source", sa.Text, nullable=False, server_default=""))
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("signature", sa.JSON(none_as_null=True)))
        batch.add_column(sa.Column("digests", sa.JSON(none_as_null=True)))
    auto_id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        "prompt_queue",
        sa.Column("id", auto_id, primary_key=True, autoincrement=True),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("answer", sa.Text, nullable=False),
        sa.Column("abandoned_by", sa.Text, nullable=False),
        sa.Column("queued_at", sa.Double, nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index("leases_open_expiry", "leases", ["state", "expires_at"])
    op.drop_index("challenges_expiry", table_name="challenges")
    op.drop_table("challenges")


def downgrade() -> None:
    op.create_table(
        "challenges",
        sa.Column("challenge", sa.Text, primary_key=True),
        sa.Column("public_key", sa.Text, nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
    )
    op.create_index("challenges_expiry", "challenges", ["expires_at"])
    op.drop_table("prompt_queue")
    op.drop_index("leases_open_expiry", table_name="leases")
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("digests")
        batch.drop_column("signature")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("source")
        batch.drop_column("prompts_abandoned")
        batch.drop_column("prompts_leased")
