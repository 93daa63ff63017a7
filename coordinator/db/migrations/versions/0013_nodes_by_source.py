"""Nodes are indexed by the source they registered from.

An identity's allowance now weighs the abandoned share of every identity registered from its source
(`coordinator.admission.source_record`): one index range per lease request, over that source's identities only.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("nodes_source", "nodes", ["source"])


def downgrade() -> None:
    op.drop_index("nodes_source", table_name="nodes")
