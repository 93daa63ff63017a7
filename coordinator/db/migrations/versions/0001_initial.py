"""The schema of the hand-written SQLite store, made or completed.

A database the hand-written store made (it has tables but no alembic_version) is adopted in place: tables it
lacks are created and columns its older versions lacked are added, with their defaults, keeping every row.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_AutoId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _nodes() -> list[sa.SchemaItem]:
    return [
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("public_key", sa.Text, nullable=False, unique=True),
        sa.Column("name", sa.Text, nullable=False, server_default=""),
        sa.Column("engine", sa.Text, nullable=False, server_default=""),
        sa.Column("registered_at", sa.Double, nullable=False),
        sa.Column("last_seen", sa.Double, nullable=False),
        sa.Column("held_version", sa.BigInteger, nullable=False, server_default="-1"),
        sa.Column("banned", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("ban_reason", sa.Text, nullable=False, server_default=""),
        sa.Column("groups_accepted", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("groups_rejected", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("reputation", sa.Double, nullable=False, server_default="0.5"),
        sa.Column("checks_passed", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("idle_s", sa.Double, nullable=False, server_default="0"),
        sa.Column("busy_s", sa.Double, nullable=False, server_default="0"),
        sa.Column("idle_total", sa.Double, nullable=False, server_default="0"),
        sa.Column("busy_total", sa.Double, nullable=False, server_default="0"),
        sa.Column("counters_at", sa.Double),
    ]


def _challenges() -> list[sa.SchemaItem]:
    return [
        sa.Column("challenge", sa.Text, primary_key=True),
        sa.Column("public_key", sa.Text, nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
    ]


def _nonces() -> list[sa.SchemaItem]:
    return [
        sa.Column("signer", sa.Text, primary_key=True),
        sa.Column("nonce", sa.Text, primary_key=True),
        sa.Column("ts", sa.Double, nullable=False),
    ]


def _leases() -> list[sa.SchemaItem]:
    return [
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("node_id", sa.Text, sa.ForeignKey("nodes.id"), nullable=False),
        sa.Column("policy_version", sa.BigInteger, nullable=False),
        sa.Column("issued_at", sa.Double, nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
        sa.Column("sampling", sa.JSON, nullable=False),
        sa.Column("state", sa.Text, nullable=False, server_default="open"),
        sa.CheckConstraint("state IN ('open', 'done')", name="leases_state"),
    ]


def _lease_prompts() -> list[sa.SchemaItem]:
    return [
        sa.Column("lease_id", sa.Text, sa.ForeignKey("leases.id"), primary_key=True),
        sa.Column("prompt_id", sa.Text, primary_key=True),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("answer", sa.Text, nullable=False),
        sa.Column("seeds", sa.JSON, nullable=False),
        sa.Column("submitted", sa.Boolean, nullable=False, server_default=sa.false()),
    ]


def _rollout_groups() -> list[sa.SchemaItem]:
    return [
        sa.Column("id", _AutoId, primary_key=True, autoincrement=True),
        sa.Column("node_id", sa.Text, sa.ForeignKey("nodes.id"), nullable=False),
        sa.Column("lease_id", sa.Text, sa.ForeignKey("leases.id"), nullable=False),
        sa.Column("prompt_id", sa.Text, nullable=False),
        sa.Column("policy_version", sa.BigInteger, nullable=False),
        sa.Column("payload", sa.JSON, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default="pending"),
        sa.Column("reason", sa.Text, nullable=False, server_default=""),
        sa.Column("rewards", sa.JSON),
        sa.Column("claimed_by", sa.Text),
        sa.Column("claimed_until", sa.Double),
        sa.Column("accepted_seq", sa.BigInteger, unique=True),
        sa.Column("submitted_at", sa.Double, nullable=False),
        sa.Column("decided_at", sa.Double),
        sa.Column("held", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.UniqueConstraint("lease_id", "prompt_id"),
        sa.CheckConstraint("status IN ('pending', 'accepted', 'rejected')", name="rollout_groups_status_values"),
    ]


def _manifests() -> list[sa.SchemaItem]:
    return [
        sa.Column("version", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("signed", sa.JSON, nullable=False),
        sa.Column("published_at", sa.Double, nullable=False),
    ]


def _metrics() -> list[sa.SchemaItem]:
    return [
        sa.Column("id", _AutoId, primary_key=True, autoincrement=True),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
        sa.Column("ts", sa.Double, nullable=False),
        sa.Column("node_idle_total", sa.Double, nullable=False, server_default="0"),
        sa.Column("node_busy_total", sa.Double, nullable=False, server_default="0"),
    ]


def _kv() -> list[sa.SchemaItem]:
    return [sa.Column("key", sa.Text, primary_key=True), sa.Column("value", sa.BigInteger, nullable=False)]


# In creation order (foreign keys point backwards); the last entry of each is the table's extra keyword args.
TABLES: list[tuple[str, Callable[[], list[sa.SchemaItem]], dict]] = [
    ("nodes", _nodes, {}),
    ("challenges", _challenges, {}),
    ("nonces", _nonces, {}),
    ("leases", _leases, {}),
    ("lease_prompts", _lease_prompts, {}),
    ("rollout_groups", _rollout_groups, {"sqlite_autoincrement": True}),
    ("manifests", _manifests, {}),
    ("metrics", _metrics, {"sqlite_autoincrement": True}),
    ("kv", _kv, {}),
]

INDEXES = [
    ("challenges_expiry", "challenges", ["expires_at"]),
    ("nonces_ts", "nonces", ["ts"]),
    ("leases_node", "leases", ["node_id", "state", "expires_at"]),
    ("rollout_groups_status", "rollout_groups", ["status", "id"]),
    ("rollout_groups_node", "rollout_groups", ["node_id", "status"]),
    ("rollout_groups_held", "rollout_groups", ["node_id", "held", "id"]),
]


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    existing = set(inspector.get_table_names())
    for name, items, kw in TABLES:
        if name not in existing:
            op.create_table(name, *items(), **kw)
            continue
        # Adopting an older database: add the columns it lacks (every such column has a default).
        have = {c["name"] for c in inspector.get_columns(name)}
        for item in items():
            if isinstance(item, sa.Column) and item.name not in have:
                op.add_column(name, item)
    indexed = {(t, i["name"]) for t in existing for i in inspector.get_indexes(t)}
    for index, table, columns in INDEXES:
        if (table, index) not in indexed:
            op.create_index(index, table, columns)


def downgrade() -> None:
    for name, _, _ in reversed(TABLES):
        op.drop_table(name)
