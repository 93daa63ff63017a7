"""Stored answers keyed by (key, signer) instead of (signer, key): a client's Idempotency-Key starts with the time
it made the request (`runtime.client.new_idempotency_key`), so a new answer's key is stored next to the previous
ones, and a commit writes one page of that index for a batch of them instead of a page picked by the signer for
each. The stored answers are copied over.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_COLUMNS = "signer, key, digest, status, body, created_at"


def _answers_table(name: str, key_first: bool) -> None:
    keys = [sa.Column("key", sa.Text, primary_key=True), sa.Column("signer", sa.Text, primary_key=True)]
    op.create_table(
        name,
        *(keys if key_first else keys[::-1]),
        sa.Column("digest", sa.Text, nullable=False),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
    )


def _replace_with(name: str, key_first: bool) -> None:
    _answers_table(name, key_first)
    op.execute(f"INSERT INTO {name} ({_COLUMNS}) SELECT {_COLUMNS} FROM idempotency_keys")
    op.drop_index("idempotency_keys_created", table_name="idempotency_keys")
    op.drop_table("idempotency_keys")
    op.rename_table(name, "idempotency_keys")
    if op.get_bind().dialect.name == "postgresql":  # its primary key's name follows the table's first name
        op.execute(f"ALTER INDEX {name}_pkey RENAME TO idempotency_keys_pkey")
    op.create_index("idempotency_keys_created", "idempotency_keys", ["created_at"])


def upgrade() -> None:
    _replace_with("idempotency_by_key", key_first=True)


def downgrade() -> None:
    _replace_with("idempotency_by_signer", key_first=False)
