"""A prompt leased again keeps its sampling seeds, and remembers the source of the identity that abandoned it.

Before this revision an abandoned prompt was leased again with fresh seeds: a node that left out the groups whose
outcome it disliked had them replaced by fresh draws, and what was trained on leaned its way. Now the prompt goes
out with the seeds it had, so on the same policy version whoever generates it reproduces the very group that was
dropped; and it goes to identities of other sources first (`coordinator.admission.take_queued`). Prompts queued
before this revision keep fresh seeds (NULL).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("prompt_queue") as batch:
        batch.add_column(sa.Column("seeds", sa.JSON(none_as_null=True)))
        batch.add_column(sa.Column("abandoned_source", sa.Text, nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("prompt_queue") as batch:
        batch.drop_column("abandoned_source")
        batch.drop_column("seeds")
