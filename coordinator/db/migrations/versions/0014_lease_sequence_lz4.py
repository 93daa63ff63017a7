"""On PostgreSQL the lease counter is a sequence, and submitted groups are compressed with lz4.

With a reproducible prompt stream (`prompt_seed`) every lease grant moved the `lease_counter` row, and its row lock
made concurrent grants wait for each other's commits. A sequence hands out numbers without a row lock (a number
taken by a transaction that rolls back is skipped). It starts after the row's value, so a pool that moves to this
revision draws no lease number twice. SQLite, where writes take turns anyway, keeps the row.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_COMPRESSED = [("rollout_groups", "payload"), ("idempotency_keys", "body")]


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("CREATE SEQUENCE lease_counter_seq AS BIGINT MINVALUE 1")
    if op.get_bind().exec_driver_sql("SELECT 'lz4' = ANY(enumvals) FROM pg_settings "
                                     "WHERE name = 'default_toast_compression'").scalar():
        for table, column in _COMPRESSED:
            op.execute(f"ALTER TABLE {table} ALTER COLUMN {column} SET COMPRESSION lz4")
    op.execute("SELECT setval('lease_counter_seq', GREATEST(1, (SELECT value FROM kv WHERE key = 'lease_counter')),"
               " (SELECT value FROM kv WHERE key = 'lease_counter') > 0)")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("UPDATE kv SET value = GREATEST(value, (SELECT last_value FROM lease_counter_seq)) "
               "WHERE key = 'lease_counter'")
    op.execute("DROP SEQUENCE lease_counter_seq")
    for table, column in _COMPRESSED:
        op.execute(f"ALTER TABLE {table} ALTER COLUMN {column} SET COMPRESSION DEFAULT")
