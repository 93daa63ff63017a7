"""Counter rows that always exist, and the acknowledged trainer feed.

The code moves each counter with one UPDATE ... RETURNING (on PostgreSQL that also locks the row until commit,
which orders the transactions that move it), so every counter row is made here, continuing what an adopted
database already counted. The trainer feed's read cursor (`trainer_cursor`, moved by reads) becomes the
acknowledged cursor (`feed_acked`, moved only by the trainer's acknowledgement).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_COUNTERS = {
    "accepted_seq": "SELECT COALESCE(MAX(accepted_seq), 0) FROM rollout_groups",
    "lease_counter": "SELECT COUNT(*) FROM leases",
    "current_version": "SELECT COALESCE(MAX(version), -1) FROM manifests",
    "feed_acked": "SELECT COALESCE((SELECT value FROM kv WHERE key = 'trainer_cursor'), 0)",
    "metrics_reports": "SELECT COUNT(*) FROM metrics",
}


def upgrade() -> None:
    bind = op.get_bind()
    for key, initial in _COUNTERS.items():
        bind.execute(sa.text(f"INSERT INTO kv (key, value) SELECT :key, ({initial}) "
                             "WHERE NOT EXISTS (SELECT 1 FROM kv WHERE key = :key)"), {"key": key})
    bind.execute(sa.text("DELETE FROM kv WHERE key = 'trainer_cursor'"))


def downgrade() -> None:
    bind = op.get_bind()
    bind.execute(sa.text("INSERT INTO kv (key, value) SELECT 'trainer_cursor', value FROM kv WHERE key = 'feed_acked'"))
    bind.execute(sa.text("DELETE FROM kv WHERE key = 'feed_acked'"))
