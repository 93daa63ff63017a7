"""Counters for the pool's liveness: how far the trainer has read the feed, and when the trainer and a verifier
were last heard from.

`feed_read` is the highest feed position handed to the trainer. Backpressure counts accepted groups after it, not
after the acknowledged cursor: a group the trainer has read is in its hands, and counting it until the step that
uses it is saved let a batch that needs more groups than the buffer leaves room for wait for ever
(`coordinator.leasequeries.buffered_groups`, docs/liveness.md). `trainer_seen_at` and `verifier_seen_at` are Unix
seconds, moved forward only, read by the watchdog (`coordinator.watchdog`).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_COUNTERS = {
    "feed_read": "SELECT COALESCE((SELECT value FROM kv WHERE key = 'feed_acked'), 0)",
    "trainer_seen_at": "SELECT 0",
    "verifier_seen_at": "SELECT 0",
}


def upgrade() -> None:
    bind = op.get_bind()
    for key, initial in _COUNTERS.items():
        bind.execute(sa.text(f"INSERT INTO kv (key, value) SELECT :key, ({initial}) "
                             "WHERE NOT EXISTS (SELECT 1 FROM kv WHERE key = :key)"), {"key": key})


def downgrade() -> None:
    op.get_bind().execute(sa.text("DELETE FROM kv WHERE key IN ('feed_read', 'trainer_seen_at', 'verifier_seen_at')"))
