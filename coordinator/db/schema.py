"""The coordinator's tables, as SQLAlchemy Core metadata: the same on SQLite and PostgreSQL.

This is what the code queries. What a database actually looks like is made by the migrations
(`coordinator/db/migrations/versions/`), which the store runs up to head when it opens; a change here goes with
a new migration. The table and column names are those of the hand-written store this replaced, so that its
databases are adopted in place (migration 0001).

A node is gone (`gone_since` set) once it has not been heard from for node_gone_after_s; its open leases were freed
then (`coordinator.liveness`), and any request of it brings it back.

A submitted group's life is in `rollout_groups`: `status` pending -> accepted | rejected, with `held` set while a
pending group waits for a later full check of its node (`coordinator.verification` holds the rules), and
`accepted_seq` its position in the trainer feed once accepted (`coordinator.feed`).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Sequence,
    Table,
    Text,
    UniqueConstraint,
    false,
)

# BIGINT on PostgreSQL (ids are never reused within a run); INTEGER on SQLite, where only an INTEGER PRIMARY KEY
# is the rowid that autoincrements (it is 64 bits there anyway).
AutoId = BigInteger().with_variant(Integer(), "sqlite")

metadata = MetaData()

nodes = Table(
    "nodes", metadata,
    Column("id", Text, primary_key=True),
    Column("public_key", Text, nullable=False, unique=True),
    Column("name", Text, nullable=False, server_default=""),
    Column("engine", Text, nullable=False, server_default=""),
    Column("registered_at", Double, nullable=False),
    Column("last_seen", Double, nullable=False),
    Column("held_version", BigInteger, nullable=False, server_default="-1"),
    Column("banned", Boolean, nullable=False, server_default=false()),
    Column("ban_reason", Text, nullable=False, server_default=""),
    Column("groups_accepted", BigInteger, nullable=False, server_default="0"),
    Column("groups_rejected", BigInteger, nullable=False, server_default="0"),
    Column("reputation", Double, nullable=False, server_default="0.5"),
    Column("checks_passed", BigInteger, nullable=False, server_default="0"),
    Column("idle_s", Double, nullable=False, server_default="0"),
    Column("busy_s", Double, nullable=False, server_default="0"),
    Column("idle_total", Double, nullable=False, server_default="0"),
    Column("busy_total", Double, nullable=False, server_default="0"),
    Column("counters_at", Double),
    Column("prompts_leased", BigInteger, nullable=False, server_default="0"),
    Column("prompts_abandoned", BigInteger, nullable=False, server_default="0"),
    Column("source", Text, nullable=False, server_default=""),
    Column("gone_since", Double),
    Column("in_flight", BigInteger, nullable=False, server_default="0"),
    Index("nodes_last_seen", "last_seen"),
    Index("nodes_source", "source"),  # an identity's allowance weighs its source's record (coordinator.admission)
)

# Keyed by time first: a request's signed timestamp is close to now, so a new record goes next to the last ones
# (not into a page of its own picked at random, which the commit would write whole), and pruning cuts the oldest
# end. A replay carries the timestamp it was signed with, so it finds its record all the same.
nonces = Table(
    "nonces", metadata,
    Column("ts", Double, primary_key=True, autoincrement=False),
    Column("signer", Text, primary_key=True),
    Column("nonce", Text, primary_key=True),
    sqlite_with_rowid=False,
)

leases = Table(
    "leases", metadata,
    Column("id", Text, primary_key=True),
    Column("node_id", Text, ForeignKey("nodes.id"), nullable=False),
    Column("policy_version", BigInteger, nullable=False),
    Column("issued_at", Double, nullable=False),
    Column("expires_at", Double, nullable=False),
    Column("sampling", JSON, nullable=False),
    Column("state", Text, nullable=False, server_default="open"),
    Column("signature", JSON(none_as_null=True)),
    Column("digests", JSON(none_as_null=True)),
    Column("flight_n", BigInteger, nullable=False, server_default="0"),
    Column("flight_class", Text, nullable=False, server_default=""),
    Column("flight_source", Text, nullable=False, server_default=""),
    Column("flight_stripe", Integer, nullable=False, server_default="0"),
    CheckConstraint("state IN ('open', 'done')", name="leases_state"),
    Index("leases_node", "node_id", "state", "expires_at"),
    Index("leases_open_expiry", "state", "expires_at"),
)

lease_prompts = Table(
    "lease_prompts", metadata,
    Column("lease_id", Text, ForeignKey("leases.id"), primary_key=True),
    Column("prompt_id", Text, primary_key=True),
    Column("position", Integer, nullable=False),
    Column("text", Text, nullable=False),
    Column("answer", Text, nullable=False),
    Column("seeds", JSON, nullable=False),
    Column("submitted", Boolean, nullable=False, server_default=false()),
)

rollout_groups = Table(
    "rollout_groups", metadata,
    Column("id", AutoId, primary_key=True, autoincrement=True),
    Column("node_id", Text, ForeignKey("nodes.id"), nullable=False),
    Column("lease_id", Text, ForeignKey("leases.id"), nullable=False),
    Column("prompt_id", Text, nullable=False),
    Column("policy_version", BigInteger, nullable=False),
    Column("payload", JSON, nullable=False),
    Column("status", Text, nullable=False, server_default="pending"),
    Column("reason", Text, nullable=False, server_default=""),
    Column("rewards", JSON(none_as_null=True)),
    Column("claimed_by", Text),
    Column("claimed_until", Double),
    Column("accepted_seq", BigInteger, unique=True),
    Column("submitted_at", Double, nullable=False),
    Column("decided_at", Double),
    Column("held", Boolean, nullable=False, server_default=false()),
    Column("vouches", Integer, nullable=False, server_default="0"),
    # The draw, made at the group's first claim and kept by every re-claim (`coordinator.verification`): the
    # quarantine rule's random number, and the node's passed checks and held groups as they stood then.
    Column("draw", Double),
    Column("draw_passes", Integer),
    Column("draw_held", Integer),
    UniqueConstraint("lease_id", "prompt_id"),
    CheckConstraint("status IN ('pending', 'accepted', 'rejected')", name="rollout_groups_status_values"),
    Index("rollout_groups_status", "status", "id"),
    Index("rollout_groups_node", "node_id", "status", "held", "id"),  # one page per new group, not two
    sqlite_autoincrement=True,
)

# Prompts leased and not used (abandoned by their node, or leased until the lease expired), waiting to be leased
# again, with the seeds they had, to another identity, of another source first (`coordinator.admission`).
prompt_queue = Table(
    "prompt_queue", metadata,
    Column("id", AutoId, primary_key=True, autoincrement=True),
    Column("text", Text, nullable=False),
    Column("answer", Text, nullable=False),
    Column("abandoned_by", Text, nullable=False),
    Column("queued_at", Double, nullable=False),
    Column("seeds", JSON(none_as_null=True)),  # NULL: fresh seeds (queued before revision 0012)
    Column("abandoned_source", Text, nullable=False, server_default=""),
    sqlite_autoincrement=True,
)

# Prompts in flight (leased, in open leases, not submitted), counted as leases open and close
# (`coordinator.inflight`): per class ('proven' and 'unproven' by policy version; 'source': unproven identities'
# by the source they registered from, any version, policy_version 0) and stripe (a hash of the node id), so that
# concurrent writers rarely wait on one row. A lease records what it was counted as (leases.flight_*), so closing
# it takes back exactly that. Rows at zero are deleted.
in_flight = Table(
    "in_flight", metadata,
    Column("cls", Text, primary_key=True),
    Column("source", Text, primary_key=True),
    Column("policy_version", BigInteger, primary_key=True, autoincrement=False),
    Column("stripe", Integer, primary_key=True, autoincrement=False),
    Column("n", BigInteger, nullable=False),
)

manifests = Table(
    "manifests", metadata,
    Column("version", BigInteger, primary_key=True, autoincrement=False),
    Column("signed", JSON, nullable=False),
    Column("published_at", Double, nullable=False),
)

metrics = Table(
    "metrics", metadata,
    Column("id", AutoId, primary_key=True, autoincrement=True),
    Column("step", BigInteger, nullable=False),
    Column("version", BigInteger, nullable=False),
    Column("data", JSON, nullable=False),
    Column("ts", Double, nullable=False),
    Column("node_idle_total", Double, nullable=False, server_default="0"),
    Column("node_busy_total", Double, nullable=False, server_default="0"),
    sqlite_autoincrement=True,
)

idempotency_keys = Table(
    "idempotency_keys", metadata,
    # The key first: a client's key starts with the request's time (`runtime.client.new_idempotency_key`), so new
    # answers are stored next to each other in this index, not at a page picked by their signer.
    Column("key", Text, primary_key=True),
    Column("signer", Text, primary_key=True),
    Column("digest", Text, nullable=False),
    Column("status", Integer, nullable=False),
    Column("body", Text, nullable=False),
    Column("created_at", Double, nullable=False),
    Index("idempotency_keys_created", "created_at"),
)
"""The answer to each request that carried an Idempotency-Key, stored in the transaction of the request's effect
(`coordinator.idempotency`): a retry of it is answered from here instead of being applied again."""
# The contribution ledger (`coordinator.ledger`): one signed receipt per accepted group, numbered by the
# RECEIPT_SEQ counter, and per node and policy version the accepted groups and tokens, both written in the
# transaction that accepts the groups.
receipts = Table(
    "receipts", metadata,
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("group_id", BigInteger, ForeignKey("rollout_groups.id"), nullable=False, unique=True),
    Column("node_id", Text, ForeignKey("nodes.id"), nullable=False),
    Column("policy_version", BigInteger, nullable=False),
    Column("tokens", BigInteger, nullable=False),
    Column("accepted_at", Double, nullable=False),
    Column("body", Text, nullable=False),
    Index("receipts_node", "node_id", "seq"),
)

ledger = Table(
    "ledger", metadata,
    Column("id", AutoId, primary_key=True, autoincrement=True),
    Column("node_id", Text, ForeignKey("nodes.id"), nullable=False),
    Column("policy_version", BigInteger, nullable=False),
    Column("groups", BigInteger, nullable=False, server_default="0"),
    Column("tokens", BigInteger, nullable=False, server_default="0"),
    Column("last_accepted_at", Double, nullable=False),
    UniqueConstraint("node_id", "policy_version"),
    sqlite_autoincrement=True,
)

# Named counters. Their rows exist from migration 0002 on, so a counter is moved by one UPDATE ... RETURNING,
# which on PostgreSQL also locks the row until the transaction ends: that lock is what orders the transactions
# that move it (see `coordinator.feed`).
kv = Table(
    "kv", metadata,
    Column("key", Text, primary_key=True),
    Column("value", BigInteger, nullable=False),
)

FEED_HEAD = "accepted_seq"
"""The last trainer-feed position handed out (0: none yet)."""
FEED_ACKED = "feed_acked"
"""The feed position up to which the trainer has acknowledged durable consumption."""
FEED_READ = "feed_read"
"""The highest feed position handed to the trainer (>= FEED_ACKED): backpressure counts accepted groups after it."""
TRAINER_SEEN_AT = "trainer_seen_at"
"""When the trainer last read the feed or acknowledged (Unix seconds; 0: never): the watchdog's."""
VERIFIER_SEEN_AT = "verifier_seen_at"
"""When a verifier last claimed groups (Unix seconds; 0: never): the watchdog's."""
LEASE_COUNTER = "lease_counter"
"""Leases issued so far: with the prompt seed, it fixes each lease's prompts (on SQLite; PostgreSQL: LEASE_SEQUENCE)."""
LEASE_SEQUENCE = Sequence("lease_counter_seq", metadata=metadata)
"""PostgreSQL's lease counter (migration 0014): numbers without a row lock that grants would wait on."""
CURRENT_VERSION = "current_version"
"""The newest published policy version (-1 before the first)."""
METRICS_REPORTS = "metrics_reports"
"""Trainer metrics reports recorded so far (its row lock orders the reports' node-time deltas)."""
RECEIPT_SEQ = "receipt_seq"
"""The last receipt number handed out (0: none yet)."""
POOL_EPOCH = "pool_epoch"
"""The store's epoch, drawn when it was first opened (`coordinator.status.store_epoch`): part of the pool's name."""
