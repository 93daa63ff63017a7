"""Durable coordinator state in SQLite: nodes, leases, submitted groups, manifests, metrics.

A submitted group is 'pending' until decided. A pending group may be *held* (held = 1): it passed the
verifier's cheap checks but not a full check, and waits, unclaimable, until full checks of later groups of its
node have vouched for it (`protocol.quarantine`; `vouches` counts them) and it is released (it becomes
'accepted') or the node is banned (it becomes 'rejected' with everything pending).

One connection, guarded by a re-entrant lock: FastAPI runs sync endpoints in a thread pool, and SQLite
connections must not be used by two threads at once. `transaction()` makes a sequence of calls atomic
(BEGIN IMMEDIATE ... COMMIT, rolled back on any exception), so a refused request changes nothing.

The SQL is kept portable to PostgreSQL on purpose (ON CONFLICT, RETURNING, no SQLite-only functions);
only the DDL's autoincrement columns and the `?` placeholders would differ. Everything goes through this
class, so a PostgreSQL store can later implement the same methods.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

Row = dict[str, Any]

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    id TEXT PRIMARY KEY,
    public_key TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL DEFAULT '',
    engine TEXT NOT NULL DEFAULT '',
    registered_at DOUBLE PRECISION NOT NULL,
    last_seen DOUBLE PRECISION NOT NULL,
    held_version BIGINT NOT NULL DEFAULT -1,
    banned INTEGER NOT NULL DEFAULT 0,
    ban_reason TEXT NOT NULL DEFAULT '',
    groups_accepted BIGINT NOT NULL DEFAULT 0,
    groups_rejected BIGINT NOT NULL DEFAULT 0,
    reputation DOUBLE PRECISION NOT NULL DEFAULT 0.5,
    checks_passed BIGINT NOT NULL DEFAULT 0,
    idle_s DOUBLE PRECISION NOT NULL DEFAULT 0,
    busy_s DOUBLE PRECISION NOT NULL DEFAULT 0,
    idle_total DOUBLE PRECISION NOT NULL DEFAULT 0,
    busy_total DOUBLE PRECISION NOT NULL DEFAULT 0,
    counters_at DOUBLE PRECISION
);
CREATE TABLE IF NOT EXISTS challenges (
    challenge TEXT PRIMARY KEY,
    public_key TEXT NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS challenges_expiry ON challenges (expires_at);
CREATE TABLE IF NOT EXISTS nonces (
    signer TEXT NOT NULL,
    nonce TEXT NOT NULL,
    ts DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (signer, nonce)
);
CREATE INDEX IF NOT EXISTS nonces_ts ON nonces (ts);
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY,
    node_id TEXT NOT NULL REFERENCES nodes (id),
    policy_version BIGINT NOT NULL,
    issued_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    sampling TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'open' CHECK (state IN ('open', 'done'))
);
CREATE INDEX IF NOT EXISTS leases_node ON leases (node_id, state, expires_at);
CREATE TABLE IF NOT EXISTS lease_prompts (
    lease_id TEXT NOT NULL REFERENCES leases (id),
    prompt_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    text TEXT NOT NULL,
    answer TEXT NOT NULL,
    seeds TEXT NOT NULL,
    submitted INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (lease_id, prompt_id)
);
CREATE TABLE IF NOT EXISTS rollout_groups (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    node_id TEXT NOT NULL REFERENCES nodes (id),
    lease_id TEXT NOT NULL REFERENCES leases (id),
    prompt_id TEXT NOT NULL,
    policy_version BIGINT NOT NULL,
    payload TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'accepted', 'rejected')),
    reason TEXT NOT NULL DEFAULT '',
    rewards TEXT,
    claimed_by TEXT,
    claimed_until DOUBLE PRECISION,
    accepted_seq BIGINT UNIQUE,
    submitted_at DOUBLE PRECISION NOT NULL,
    decided_at DOUBLE PRECISION,
    held INTEGER NOT NULL DEFAULT 0,
    vouches INTEGER NOT NULL DEFAULT 0,
    UNIQUE (lease_id, prompt_id)
);
CREATE INDEX IF NOT EXISTS rollout_groups_status ON rollout_groups (status, id);
CREATE INDEX IF NOT EXISTS rollout_groups_node ON rollout_groups (node_id, status);
CREATE TABLE IF NOT EXISTS manifests (
    version BIGINT PRIMARY KEY,
    signed TEXT NOT NULL,
    published_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS metrics (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    step BIGINT NOT NULL,
    version BIGINT NOT NULL,
    data TEXT NOT NULL,
    ts DOUBLE PRECISION NOT NULL,
    node_idle_total DOUBLE PRECISION NOT NULL DEFAULT 0,
    node_busy_total DOUBLE PRECISION NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value BIGINT NOT NULL
);
"""


class Store:
    """All coordinator state. Every method is atomic on its own; wrap several in `transaction()`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._depth = 0
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, so transactions are exactly what we say.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        with self.transaction():
            for stmt in (s.strip() for s in SCHEMA.split(";")):
                if stmt:
                    self._db.execute(stmt)
            self._migrate()
            # After the migration: an older database gets the column first.
            self._db.execute("CREATE INDEX IF NOT EXISTS rollout_groups_held ON rollout_groups (node_id, held, id)")

    def _migrate(self) -> None:
        """Add columns that databases made by earlier versions lack (SQLite keeps old tables as they were)."""
        for table, column, ddl in (("nodes", "checks_passed", "BIGINT NOT NULL DEFAULT 0"),
                                   ("rollout_groups", "held", "INTEGER NOT NULL DEFAULT 0"),
                                   ("rollout_groups", "vouches", "INTEGER NOT NULL DEFAULT 0"),
                                   ("nodes", "idle_s", "DOUBLE PRECISION NOT NULL DEFAULT 0"),
                                   ("nodes", "busy_s", "DOUBLE PRECISION NOT NULL DEFAULT 0"),
                                   ("nodes", "idle_total", "DOUBLE PRECISION NOT NULL DEFAULT 0"),
                                   ("nodes", "busy_total", "DOUBLE PRECISION NOT NULL DEFAULT 0"),
                                   ("nodes", "counters_at", "DOUBLE PRECISION"),
                                   ("metrics", "node_idle_total", "DOUBLE PRECISION NOT NULL DEFAULT 0"),
                                   ("metrics", "node_busy_total", "DOUBLE PRECISION NOT NULL DEFAULT 0")):
            have = {r["name"] for r in self._db.execute(f"PRAGMA table_info({table})").fetchall()}
            if column not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {ddl}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- plumbing -------------------------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Run the enclosed calls atomically; nested uses join the outer transaction."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            self._db.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            else:
                self._db.execute("COMMIT")
            finally:
                self._depth = 0

    def _exec(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, params)

    def _one(self, sql: str, params: tuple[Any, ...] = ()) -> Row | None:
        with self._lock:
            # fetchall, not fetchone: steps the statement to its end, so a RETURNING statement is finished.
            rows = self._db.execute(sql, params).fetchall()
        return dict(rows[0]) if rows else None

    def _all(self, sql: str, params: tuple[Any, ...] = ()) -> list[Row]:
        with self._lock:
            return [dict(r) for r in self._db.execute(sql, params).fetchall()]

    # -- kv counters ----------------------------------------------------------------------------------

    def get_int(self, key: str, default: int) -> int:
        row = self._one("SELECT value FROM kv WHERE key = ?", (key,))
        return int(row["value"]) if row else default

    def set_int(self, key: str, value: int) -> None:
        self._exec("INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                   (key, value))

    def next_int(self, key: str) -> int:
        """Increment counter `key` (starting from 0) and return its new value: 1, 2, 3, ..."""
        with self.transaction():
            self._exec("INSERT INTO kv (key, value) VALUES (?, 0) ON CONFLICT (key) DO NOTHING", (key,))
            row = self._one("UPDATE kv SET value = value + 1 WHERE key = ? RETURNING value", (key,))
        assert row is not None
        return int(row["value"])

    # -- nonces and challenges ------------------------------------------------------------------------

    def record_nonce(self, signer: str, nonce: str, ts: float) -> bool:
        """Remember (signer, nonce); False if it was already recorded (a replay)."""
        row = self._one("INSERT INTO nonces (signer, nonce, ts) VALUES (?, ?, ?) ON CONFLICT DO NOTHING "
                        "RETURNING signer", (signer, nonce, ts))
        return row is not None

    def prune_nonces(self, older_than: float) -> int:
        return self._exec("DELETE FROM nonces WHERE ts < ?", (older_than,)).rowcount

    def add_challenge(self, challenge: str, public_key: str, expires_at: float, now: float, limit: int) -> bool:
        """Store a challenge after dropping expired ones; False when `limit` are already outstanding."""
        with self.transaction():
            self._exec("DELETE FROM challenges WHERE expires_at < ?", (now,))
            count = self._one("SELECT COUNT(*) AS n FROM challenges")
            if count and count["n"] >= limit:
                return False
            self._exec("INSERT INTO challenges (challenge, public_key, expires_at) VALUES (?, ?, ?)",
                       (challenge, public_key, expires_at))
        return True

    def take_challenge(self, challenge: str, public_key: str, now: float) -> bool:
        """Consume a challenge issued to `public_key` and still valid; False (and nothing consumed) otherwise."""
        row = self._one("DELETE FROM challenges WHERE challenge = ? AND public_key = ? AND expires_at >= ? "
                        "RETURNING challenge", (challenge, public_key, now))
        return row is not None

    # -- nodes ----------------------------------------------------------------------------------------

    def upsert_node(self, node_id: str, public_key: str, name: str, engine: str, now: float) -> None:
        """Register a node, or refresh its name and engine; counters and ban state are kept."""
        self._exec(
            "INSERT INTO nodes (id, public_key, name, engine, registered_at, last_seen) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET name = excluded.name, engine = excluded.engine, "
            "last_seen = excluded.last_seen",
            (node_id, public_key, name, engine, now, now),
        )

    def get_node(self, node_id: str) -> Row | None:
        return self._one("SELECT * FROM nodes WHERE id = ?", (node_id,))

    def list_nodes(self) -> list[Row]:
        return self._all("SELECT * FROM nodes ORDER BY registered_at, id")

    def touch_node(self, node_id: str, now: float, held_version: int | None = None) -> None:
        if held_version is None:
            self._exec("UPDATE nodes SET last_seen = ? WHERE id = ?", (now, node_id))
        else:
            self._exec("UPDATE nodes SET last_seen = ?, held_version = ? WHERE id = ?", (now, held_version, node_id))

    def count_node_verdict(self, node_id: str, accepted: int = 0, rejected: int = 0) -> None:
        """Add to a node's verdict counters; reputation is its Laplace-smoothed acceptance rate."""
        self._exec(
            "UPDATE nodes SET groups_accepted = groups_accepted + ?, groups_rejected = groups_rejected + ?, "
            "reputation = (groups_accepted + ? + 1.0) / (groups_accepted + groups_rejected + ? + 2.0) WHERE id = ?",
            (accepted, rejected, accepted, accepted + rejected, node_id),
        )

    def count_node_check(self, node_id: str) -> None:
        """One more full check passed by the node."""
        self._exec("UPDATE nodes SET checks_passed = checks_passed + 1 WHERE id = ?", (node_id,))

    def set_node_counters(self, node_id: str, idle_s: float, busy_s: float, add_idle: float, add_busy: float,
                          now: float) -> None:
        """Store a node's latest self-reported counters (`idle_s`, `busy_s`, as reported) and add to its
        coordinator-side totals (`idle_total`, `busy_total`, which never decrease, whatever the node reports)."""
        self._exec("UPDATE nodes SET idle_s = ?, busy_s = ?, idle_total = idle_total + ?, busy_total = busy_total + ?, "
                   "counters_at = ? WHERE id = ?", (idle_s, busy_s, add_idle, add_busy, now, node_id))

    def node_time_totals(self) -> tuple[float, float]:
        """(idle, busy): the coordinator-side totals of every node, banned ones included, summed."""
        row = self._one("SELECT COALESCE(SUM(idle_total), 0) AS idle, COALESCE(SUM(busy_total), 0) AS busy FROM nodes")
        assert row is not None
        return float(row["idle"]), float(row["busy"])

    def ban_node(self, node_id: str, reason: str) -> None:
        self._exec("UPDATE nodes SET banned = 1, ban_reason = ? WHERE id = ?", (reason, node_id))

    def node_counts(self) -> Row:
        row = self._one("SELECT COUNT(*) AS total, COALESCE(SUM(banned), 0) AS banned FROM nodes")
        assert row is not None
        return row

    # -- leases ---------------------------------------------------------------------------------------

    def count_open_leases(self, node_id: str, now: float) -> int:
        row = self._one("SELECT COUNT(*) AS n FROM leases WHERE node_id = ? AND state = 'open' AND expires_at > ?",
                        (node_id, now))
        return int(row["n"]) if row else 0

    def insert_lease(self, lease_id: str, node_id: str, policy_version: int, issued_at: float, expires_at: float,
                     sampling: dict[str, Any], prompts: list[tuple[str, str, str, list[int]]]) -> None:
        """Store a lease and its prompts, each (prompt_id, text, answer, seeds)."""
        with self.transaction():
            self._exec("INSERT INTO leases (id, node_id, policy_version, issued_at, expires_at, sampling) "
                       "VALUES (?, ?, ?, ?, ?, ?)",
                       (lease_id, node_id, policy_version, issued_at, expires_at, json.dumps(sampling)))
            for pos, (prompt_id, text, answer, seeds) in enumerate(prompts):
                self._exec("INSERT INTO lease_prompts (lease_id, prompt_id, position, text, answer, seeds) "
                           "VALUES (?, ?, ?, ?, ?, ?)", (lease_id, prompt_id, pos, text, answer, json.dumps(seeds)))

    def get_lease(self, lease_id: str) -> Row | None:
        row = self._one("SELECT * FROM leases WHERE id = ?", (lease_id,))
        if row is not None:
            row["sampling"] = json.loads(row["sampling"])
        return row

    def lease_prompts(self, lease_id: str) -> dict[str, Row]:
        """The lease's prompts by prompt id, seeds decoded, answers included (server side only)."""
        rows = self._all("SELECT * FROM lease_prompts WHERE lease_id = ? ORDER BY position", (lease_id,))
        for r in rows:
            r["seeds"] = json.loads(r["seeds"])
        return {r["prompt_id"]: r for r in rows}

    def mark_prompt_submitted(self, lease_id: str, prompt_id: str) -> bool:
        """Flag a prompt submitted; False if it already was (so a racing duplicate cannot slip through)."""
        cur = self._exec("UPDATE lease_prompts SET submitted = 1 WHERE lease_id = ? AND prompt_id = ? "
                         "AND submitted = 0", (lease_id, prompt_id))
        return cur.rowcount == 1

    def close_lease(self, lease_id: str) -> None:
        self._exec("UPDATE leases SET state = 'done' WHERE id = ?", (lease_id,))

    def close_lease_if_complete(self, lease_id: str) -> bool:
        cur = self._exec("UPDATE leases SET state = 'done' WHERE id = ? AND state = 'open' AND NOT EXISTS "
                         "(SELECT 1 FROM lease_prompts WHERE lease_id = ? AND submitted = 0)", (lease_id, lease_id))
        return cur.rowcount == 1

    # -- rollout groups -------------------------------------------------------------------------------

    def insert_group(self, node_id: str, lease_id: str, prompt_id: str, policy_version: int,
                     payload: dict[str, Any], now: float) -> int:
        row = self._one("INSERT INTO rollout_groups (node_id, lease_id, prompt_id, policy_version, payload, "
                        "submitted_at) VALUES (?, ?, ?, ?, ?, ?) RETURNING id",
                        (node_id, lease_id, prompt_id, policy_version, json.dumps(payload), now))
        assert row is not None
        return int(row["id"])

    def claim_pending(self, claimer: str, limit: int, now: float, until: float) -> list[Row]:
        """Claim up to `limit` pending groups nobody holds a live claim on, oldest first, with their lease facts."""
        with self.transaction():
            ids = [r["id"] for r in self._all(
                "SELECT id FROM rollout_groups WHERE status = 'pending' AND held = 0 AND (claimed_until IS NULL OR "
                "claimed_until < ?) ORDER BY id LIMIT ?", (now, limit))]
            for gid in ids:
                self._exec("UPDATE rollout_groups SET claimed_by = ?, claimed_until = ? WHERE id = ?",
                           (claimer, until, gid))
            rows = [self._one(
                "SELECT g.*, p.text AS prompt_text, p.answer, p.seeds, l.policy_version AS lease_version, "
                "l.sampling, n.checks_passed AS node_checks_passed, (SELECT COUNT(*) FROM rollout_groups h WHERE "
                "h.node_id = g.node_id AND h.status = 'pending' AND h.held = 1) AS node_held "
                "FROM rollout_groups g JOIN lease_prompts p ON "
                "p.lease_id = g.lease_id AND p.prompt_id = g.prompt_id JOIN leases l ON l.id = g.lease_id "
                "JOIN nodes n ON n.id = g.node_id WHERE g.id = ?", (gid,)) for gid in ids]
        out = [r for r in rows if r is not None]
        for r in out:
            r["payload"] = json.loads(r["payload"])
            r["seeds"] = json.loads(r["seeds"])
            r["sampling"] = json.loads(r["sampling"])
        return out

    def get_group(self, group_id: int) -> Row | None:
        row = self._one("SELECT * FROM rollout_groups WHERE id = ?", (group_id,))
        if row is not None:
            row["payload"] = json.loads(row["payload"])
        return row

    def accept_group(self, group_id: int, rewards: list[float], now: float) -> int | None:
        """Mark a pending group accepted and give it the next training cursor value, which is returned.

        None (and no cursor value used) if the group is not pending. The cursor comes from a counter row
        updated in the same transaction, so cursors become visible in increasing order and a trainer
        reading `accepted_seq > cursor` never skips one.
        """
        with self.transaction():
            if not self._one("SELECT 1 AS x FROM rollout_groups WHERE id = ? AND status = 'pending'", (group_id,)):
                return None
            seq = self.next_int("accepted_seq")
            self._exec("UPDATE rollout_groups SET status = 'accepted', rewards = ?, accepted_seq = ?, decided_at = ?, "
                       "claimed_until = NULL, held = 0 WHERE id = ? AND status = 'pending'",
                       (json.dumps(rewards), seq, now, group_id))
        return seq

    def hold_group(self, group_id: int, rewards: list[float], now: float) -> bool:
        """Hold a pending, unheld group with its trusted rewards; False if it is not such a group."""
        cur = self._exec("UPDATE rollout_groups SET held = 1, rewards = ?, decided_at = ?, claimed_until = NULL "
                         "WHERE id = ? AND status = 'pending' AND held = 0", (json.dumps(rewards), now, group_id))
        return cur.rowcount == 1

    def held_of_node(self, node_id: str) -> list[Row]:
        """The node's held groups (id, vouches), oldest first."""
        return self._all("SELECT id, vouches FROM rollout_groups WHERE node_id = ? AND status = 'pending' AND held = 1 "
                         "ORDER BY id", (node_id,))

    def set_vouches(self, group_id: int, vouches: int) -> None:
        self._exec("UPDATE rollout_groups SET vouches = ? WHERE id = ? AND status = 'pending' AND held = 1",
                   (vouches, group_id))

    def release_held(self, group_ids: list[int], now: float) -> list[int]:
        """Accept held groups, in the given order, with the rewards stored when they were held; returns those that
        were still held."""
        released = []
        with self.transaction():
            for gid in group_ids:
                row = self._one("SELECT rewards FROM rollout_groups WHERE id = ? AND status = 'pending' AND held = 1",
                                (gid,))
                if row is not None and self.accept_group(gid, json.loads(row["rewards"]), now) is not None:
                    released.append(gid)
        return released

    def held_count(self) -> int:
        row = self._one("SELECT COUNT(*) AS n FROM rollout_groups WHERE status = 'pending' AND held = 1")
        return int(row["n"]) if row else 0

    def reject_group(self, group_id: int, reason: str, now: float) -> None:
        self._exec("UPDATE rollout_groups SET status = 'rejected', reason = ?, decided_at = ?, claimed_until = NULL "
                   "WHERE id = ? AND status = 'pending'", (reason, now, group_id))

    def reject_pending_of_node(self, node_id: str, reason: str, now: float) -> int:
        """Reject every still-pending group of a node, held ones included; returns how many."""
        return self._exec("UPDATE rollout_groups SET status = 'rejected', reason = ?, decided_at = ?, "
                          "claimed_until = NULL WHERE node_id = ? AND status = 'pending'",
                          (reason, now, node_id)).rowcount

    def buffered_work(self, min_version: int, trainer_cursor: int, now: float) -> int:
        """Groups in flight that the trainer may still use: leased and not yet submitted, submitted and not yet
        decided, or accepted and not yet taken by the trainer; all of policy version >= `min_version`."""
        leased = self._one(
            "SELECT COUNT(*) AS n FROM lease_prompts p JOIN leases l ON l.id = p.lease_id "
            "WHERE p.submitted = 0 AND l.state = 'open' AND l.expires_at > ? AND l.policy_version >= ?",
            (now, min_version))
        groups = self._one(
            "SELECT COUNT(*) AS n FROM rollout_groups WHERE policy_version >= ? AND "
            "(status = 'pending' OR (status = 'accepted' AND accepted_seq > ?))", (min_version, trainer_cursor))
        return int(leased["n"] if leased else 0) + int(groups["n"] if groups else 0)

    def accepted_after(self, after_seq: int, limit: int) -> list[Row]:
        rows = self._all("SELECT * FROM rollout_groups WHERE status = 'accepted' AND accepted_seq > ? "
                         "ORDER BY accepted_seq LIMIT ?", (after_seq, limit))
        for r in rows:
            r["payload"] = json.loads(r["payload"])
            r["rewards"] = json.loads(r["rewards"])
        return rows

    def group_counts(self) -> dict[str, int]:
        counts = {"pending": 0, "accepted": 0, "rejected": 0}
        for r in self._all("SELECT status, COUNT(*) AS n FROM rollout_groups GROUP BY status"):
            counts[r["status"]] = int(r["n"])
        return counts

    # -- manifests and metrics ------------------------------------------------------------------------

    def insert_manifest(self, version: int, signed: dict[str, Any], now: float) -> None:
        self._exec("INSERT INTO manifests (version, signed, published_at) VALUES (?, ?, ?)",
                   (version, json.dumps(signed), now))

    def get_manifest(self, version: int) -> dict[str, Any] | None:
        row = self._one("SELECT signed FROM manifests WHERE version = ?", (version,))
        return json.loads(row["signed"]) if row else None

    def latest_manifests(self, n: int) -> list[dict[str, Any]]:
        """The `n` newest manifests (signed JSON), newest first."""
        return [json.loads(r["signed"]) for r in
                self._all("SELECT signed FROM manifests ORDER BY version DESC LIMIT ?", (n,))]

    def insert_metrics(self, step: int, version: int, data: dict[str, float], now: float,
                       node_totals: tuple[float, float] = (0.0, 0.0)) -> None:
        """Store a metrics row with `node_totals`, the swarm's (idle, busy) totals when it was recorded."""
        self._exec("INSERT INTO metrics (step, version, data, ts, node_idle_total, node_busy_total) "
                   "VALUES (?, ?, ?, ?, ?, ?)", (step, version, json.dumps(data), now, *node_totals))

    def last_metrics_node_totals(self) -> tuple[float, float]:
        """The swarm's (idle, busy) totals stored with the newest metrics row; (0, 0) before the first."""
        row = self._one("SELECT node_idle_total, node_busy_total FROM metrics ORDER BY id DESC LIMIT 1")
        return (float(row["node_idle_total"]), float(row["node_busy_total"])) if row else (0.0, 0.0)

    def recent_metrics(self, n: int) -> list[Row]:
        """The last `n` metrics rows, oldest first."""
        rows = self._all("SELECT * FROM metrics ORDER BY id DESC LIMIT ?", (n,))
        for r in rows:
            r["data"] = json.loads(r["data"])
        return rows[::-1]
