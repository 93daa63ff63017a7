"""The sources holding unproven prompts are counted, not recounted at each lease request.

A lease request of an unproven identity divides the unproven share among the sources holding unproven prompts
(`coordinator.admission.source_share`). It counted them by reading every `source` row of `in_flight`, one per
source and stripe, and sorting them: a row per source, at every request. Now a source's prompts are one row
(stripe 0), and rows of class `sources` count those rows, moved as one is created or emptied
(`coordinator.inflight.apply`). This revision merges each source's rows and writes the count.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07
"""

from __future__ import annotations

import zlib
from collections import Counter

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_STRIPES = 16  # coordinator.inflight.STRIPES, as of this revision
_in_flight = sa.table("in_flight", sa.column("cls", sa.Text), sa.column("source", sa.Text),
                      sa.column("policy_version", sa.BigInteger), sa.column("stripe", sa.Integer),
                      sa.column("n", sa.BigInteger))
_leases = sa.table("leases", sa.column("state", sa.Text), sa.column("flight_n", sa.BigInteger),
                   sa.column("flight_class", sa.Text), sa.column("flight_source", sa.Text),
                   sa.column("flight_stripe", sa.Integer))


def _stripe(source: str) -> int:
    return zlib.crc32(source.encode()) % _STRIPES  # coordinator.inflight.stripe, as of this revision


def _recount(by_stripe: bool) -> list[dict[str, object]]:
    """The `source` rows, from the open leases of unproven identities (what they count): one per source, or (before
    this revision) one per source and stripe."""
    lease = _leases.c
    keys = [lease.flight_source] + ([lease.flight_stripe] if by_stripe else [])
    rows = op.get_bind().execute(sa.select(*keys, sa.func.sum(lease.flight_n)).where(
        lease.state == "open", lease.flight_class == "unproven").group_by(*keys).order_by(*keys)).all()
    return [dict(cls="source", source=r[0], policy_version=0, stripe=r[1] if by_stripe else 0, n=r[-1])
            for r in rows if r[-1] > 0]


def _replace_source_rows(rows: list[dict[str, object]]) -> None:
    op.execute(_in_flight.delete().where(_in_flight.c.cls.in_(("source", "sources"))))
    if rows:
        op.bulk_insert(_in_flight, rows)


def upgrade() -> None:
    rows = _recount(by_stripe=False)
    counts = Counter(_stripe(str(row["source"])) for row in rows)
    _replace_source_rows(rows + [dict(cls="sources", source="", policy_version=0, stripe=s, n=n)
                                 for s, n in sorted(counts.items())])


def downgrade() -> None:
    _replace_source_rows(_recount(by_stripe=True))
