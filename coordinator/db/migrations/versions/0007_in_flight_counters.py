"""Prompts in flight counted as leases open and close (`coordinator.inflight`), instead of recounted per request.

- nodes.in_flight: the prompts of the node's open leases;
- leases.flight_n / flight_class / flight_source / flight_stripe: what an open lease was counted as, so that its
  closing takes back exactly that;
- in_flight: the counters, per (class, source, policy version, stripe).

The counters are filled from the open leases found here: each counts its prompts not submitted, as a proven node's
if its node has 8 accepted groups (admission.proven_after_groups' default: a migration does not read the
operator's configuration; a lease lasts lease_ttl_s, after which every lease is counted by the configured rule),
else as an unproven one of its node's source, in stripe 0.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

PROVEN_AFTER_GROUPS = 8


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("in_flight", sa.BigInteger, nullable=False, server_default="0"))
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("flight_n", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("flight_class", sa.Text, nullable=False, server_default=""))
        batch.add_column(sa.Column("flight_source", sa.Text, nullable=False, server_default=""))
        batch.add_column(sa.Column("flight_stripe", sa.Integer, nullable=False, server_default="0"))
    counters = op.create_table(
        "in_flight",
        sa.Column("cls", sa.Text, primary_key=True),
        sa.Column("source", sa.Text, primary_key=True),
        sa.Column("policy_version", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("stripe", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("n", sa.BigInteger, nullable=False),
    )
    _fill(op.get_bind(), counters)


def _fill(conn: sa.Connection, counters: sa.Table) -> None:
    nodes = sa.table("nodes", sa.column("id"), sa.column("groups_accepted"), sa.column("source"),
                     sa.column("in_flight"))
    leases = sa.table("leases", sa.column("id"), sa.column("node_id"), sa.column("policy_version"),
                      sa.column("state"), sa.column("flight_n"), sa.column("flight_class"), sa.column("flight_source"))
    prompts = sa.table("lease_prompts", sa.column("lease_id"), sa.column("submitted", sa.Boolean))
    unsubmitted = (sa.select(sa.func.count()).where(prompts.c.lease_id == leases.c.id, prompts.c.submitted.is_(False))
                   .scalar_subquery())
    rows = conn.execute(sa.select(leases.c.id, leases.c.node_id, leases.c.policy_version, nodes.c.groups_accepted,
                                  nodes.c.source, unsubmitted.label("n"))
                        .select_from(leases.join(nodes, nodes.c.id == leases.c.node_id))
                        .where(leases.c.state == "open")).all()
    per_node: dict[str, int] = {}
    per_key: dict[tuple[str, str, int], int] = {}
    for lease_id, node_id, version, accepted, source, n in rows:
        proven = accepted >= PROVEN_AFTER_GROUPS
        cls, src = ("proven", "") if proven else ("unproven", source)
        conn.execute(sa.update(leases).where(leases.c.id == lease_id).values(flight_n=n, flight_class=cls,
                                                                               flight_source=src))
        per_node[node_id] = per_node.get(node_id, 0) + n
        keys = [(cls, "", version)] + ([] if proven else [("source", src, 0)])
        for key in keys:
            per_key[key] = per_key.get(key, 0) + n
    for node_id, n in sorted(per_node.items()):
        conn.execute(sa.update(nodes).where(nodes.c.id == node_id).values(in_flight=n))
    if any(per_key.values()):
        conn.execute(counters.insert(), [{"cls": c, "source": s, "policy_version": v, "stripe": 0, "n": n}
                                         for (c, s, v), n in sorted(per_key.items()) if n])


def downgrade() -> None:
    op.drop_table("in_flight")
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("flight_stripe")
        batch.drop_column("flight_source")
        batch.drop_column("flight_class")
        batch.drop_column("flight_n")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("in_flight")
