"""Each group's draw is made once and kept: the random number the verifier's quarantine rule reads, and the
node's passed checks and held groups as they stood at the group's first claim.

Before this revision a verifier drew afresh on every claim. A full check that outlasted the claim TTL let a second
verifier claim the group and draw again, and the first verdict to land won: a cheater faced about p squared
instead of p (docs/quarantine.md, "Re-claims and crashed verifiers"). Groups claimed before this revision get
their draw at their next claim.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rollout_groups") as batch:
        batch.add_column(sa.Column("draw", sa.Double))
        batch.add_column(sa.Column("draw_passes", sa.Integer))
        batch.add_column(sa.Column("draw_held", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("rollout_groups") as batch:
        batch.drop_column("draw_held")
        batch.drop_column("draw_passes")
        batch.drop_column("draw")
