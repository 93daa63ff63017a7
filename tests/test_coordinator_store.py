"""The coordinator's storage without HTTP, on SQLite and on a real PostgreSQL server (skipped, saying why, when
SWARMRL_TEST_PG_URL is unset): transactions, nonces, challenges, nodes, leases, the group lifecycle, the trainer
feed's positions under concurrent accepting transactions, migrations on reopen; and the coordinator's config."""

from __future__ import annotations

import sqlite3
import stat
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, text

from swarmrl.coordinator import admission, feed, inflight, leasequeries, nonces, registry, status, verification
from swarmrl.coordinator.checkpoints import current_version, get_manifest, latest_manifests
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.rows import NodeRow
from swarmrl.coordinator.db.schema import CURRENT_VERSION, LEASE_COUNTER, manifests, metadata
from swarmrl.coordinator.db.sqlite.config import SqliteConfig
from swarmrl.coordinator.db.store import Store, Tx, add_to_counter, counter, raise_counter, upgrade
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.manifest import CheckpointManifest, SignedManifest
from swarmrl.runtime.config import ConfigError, load_config
from tests.support.postgres import fresh_database, needs_pg

HEAD = "0015"
"""The newest migration's revision."""


def _revision(store: Store) -> str:
    """The migration revision `store`'s database is at."""
    return store.read(lambda tx: tx.execute(text("SELECT version_num FROM alembic_version")).scalar_one())


@pytest.fixture
def store(store_url: str):  # noqa: F811
    s = Store(store_url)
    yield s
    s.close()


def _node(store: Store, node_id: str = "n1") -> None:
    store.write(lambda tx: registry.upsert_node(tx, node_id, node_id.ljust(64, "0"), "name", "torch", now=100.0))


def _lease(store: Store, lease_id: str = "L1", node_id: str = "n1", prompts: int = 2, expires_at: float = 200.0):
    store.write(lambda tx: leasequeries.insert_lease(
        tx, lease_id, node_id, 0, 100.0, expires_at, {"group_size": 2},
        [(f"{lease_id}.{i}", f"{i}+{i}=", str(2 * i), [10 + i, 20 + i]) for i in range(prompts)]))


def _group(store: Store, lease_id: str = "L1", prompt: str = "L1.0", node_id: str = "n1") -> int:
    return store.write(lambda tx: leasequeries.insert_group(tx, node_id, lease_id, prompt, 0,
                                                      {"prompt_id": prompt, "rollouts": [{}, {}]}, now=101.0))


def _get_node(store: Store, node_id: str = "n1") -> NodeRow | None:
    return store.read(lambda tx: registry.get_node(tx, node_id))


def test_a_failed_transaction_changes_nothing(store: Store) -> None:
    def half_done(tx: Tx) -> None:
        registry.upsert_node(tx, "n1", "k1", "name", "torch", now=1.0)
        raise_counter(tx, CURRENT_VERSION, 5)
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError):
        store.write(half_done)
    assert _get_node(store) is None
    assert store.read(current_version) == -1
    _node(store)
    assert _get_node(store).name == "name"


def test_nonces_refuse_replays_and_are_pruned(store: Store) -> None:
    record = lambda signer, nonce, ts: store.write(lambda tx: nonces.record_nonce(tx, signer, nonce, ts))  # noqa: E731
    assert record("a", "n1", 10.0)
    assert not record("a", "n1", 10.0)
    assert record("b", "n1", 10.0)  # per signer
    assert record("a", "n2", 500.0)
    assert store.write(lambda tx: nonces.prune_nonces(tx, older_than=100.0)) == 2
    assert not record("a", "n2", 500.0)


def test_challenges_are_bound_single_use_and_expire(store: Store, tmp_path: Path) -> None:
    """A challenge is a MAC under the run's secret: nothing is stored when it is issued, any number may be out."""
    from swarmrl.coordinator.run_secret import RunSecret

    secret = RunSecret(tmp_path)
    key_a, key_b = "a" * 64, "b" * 64
    take = lambda c, key, now, s=secret: store.write(lambda tx: registry.take_challenge(tx, s, c, key, now))  # noqa
    c1 = registry.challenge_for(secret, key_a, expires_at=160.0)
    assert not take(c1, key_b, 110.0)  # someone else's: not consumed
    assert take(c1, key_a, 110.0)
    assert not take(c1, key_a, 111.0)  # single use
    c2 = registry.challenge_for(secret, key_a, expires_at=160.0)
    assert c2 == c1 and not take(c2, key_a, 112.0)  # the same again is the same, still used
    assert not take(registry.challenge_for(secret, key_a, expires_at=170.0), key_a, 171.0)  # expired
    assert not take(registry.challenge_for(RunSecret(tmp_path / "other"), key_a, 300.0), key_a, 200.0)  # not ours
    assert not take("not-a-challenge", key_a, 200.0)
    assert oct((tmp_path / "run.secret").stat().st_mode & 0o777) == "0o600"
    assert RunSecret(tmp_path).derive("x") == secret.derive("x") != RunSecret(tmp_path / "other").derive("x")


def test_node_upsert_keeps_counters_and_ban(store: Store) -> None:
    _node(store)
    store.write(lambda tx: registry.count_verdicts(tx, "n1", accepted=3, rejected=1))
    store.write(lambda tx: registry.ban(tx, "n1", "forged logprobs"))
    store.write(lambda tx: registry.upsert_node(tx, "n1", "n1".ljust(64, "0"), "renamed", "vllm", now=150.0))
    node = _get_node(store)
    assert (node.name, node.engine, node.last_seen, node.registered_at) == ("renamed", "vllm", 150.0, 100.0)
    assert (node.groups_accepted, node.groups_rejected, node.banned) == (3, 1, True)
    assert node.ban_reason == "forged logprobs"
    assert node.reputation == pytest.approx((3 + 1) / (4 + 2))
    assert [n.id for n in store.read(registry.list_nodes)] == ["n1"]


def test_leases_prompts_and_submission_flags(store: Store) -> None:
    _node(store)
    _lease(store, "L1", expires_at=200.0)
    _lease(store, "L2", expires_at=120.0)
    open_at = lambda now: store.read(lambda tx: leasequeries.count_open_leases(tx, "n1", now))  # noqa: E731
    assert open_at(110.0) == 2
    assert open_at(150.0) == 1  # L2 expired
    prompts = store.read(lambda tx: leasequeries.get_prompts(tx, "L1"))
    assert list(prompts) == ["L1.0", "L1.1"] and prompts["L1.1"].seeds == [11, 21]
    store.write(lambda tx: raise_counter(tx, CURRENT_VERSION, 4))
    lease, version = store.write(lambda tx: leasequeries.lock_lease(tx, "L1"))
    assert prompts["L1.1"].answer == "2" and lease.sampling == {"group_size": 2} and lease.id == "L1"
    assert version == 4  # the current version, read with the lease
    assert store.write(lambda tx: leasequeries.lock_lease(tx, "L9")) is None
    mark = lambda p: store.write(lambda tx: leasequeries.mark_submitted(tx, "L1", p))  # noqa: E731
    assert mark("L1.0")
    assert not mark("L1.0")
    # Settling a lease queues what was not submitted, counted against its node; a settled lease stays settled.
    assert store.write(lambda tx: admission.settle_lease(tx, "L1", now=110.0)) == 1
    assert store.write(lambda tx: admission.settle_lease(tx, "L1", now=110.0)) == 0
    assert open_at(110.0) == 1
    node = _get_node(store)
    assert node.prompts_abandoned == 1
    take = lambda node_id, n, source="", now=110.0: store.write(  # noqa: E731
        lambda tx: admission.take_queued(tx, node_id, source, n, now, same_source_after_s=60.0))
    assert take("n1", 5) == []  # not back to the node that left it
    # A grant reads the queue only when the counters' statement says a prompt waits there for its node.
    _node(store, "n2")
    waits_for = lambda node_id: store.read(lambda tx: admission.in_flight(  # noqa: E731
        tx, registry.get_node(tx, node_id), 0).queued)
    assert not waits_for("n1") and waits_for("n2")
    # An expired lease is settled by the sweep the same way.
    assert store.write(lambda tx: admission.sweep_expired(tx, now=150.0, limit=10)) == 2
    assert _get_node(store).prompts_abandoned == 3
    # Not to another identity of the abandoner's source, until the prompt has waited same_source_after_s; to one
    # of another source at once. With the seeds it had: on the same version it gives the same group again.
    assert take("n2", 2) == []
    assert take("n2", 2, source="10.0.0.2") == [("1+1=", "2", [11, 21]), ("0+0=", "0", [10, 20])]
    assert take("n2", 2, now=209.0) == [] and take("n2", 2, now=210.0) == [("1+1=", "2", [11, 21])]
    assert store.read(admission.queued) == 0


def test_group_lifecycle_claims_and_feed(store: Store) -> None:
    _node(store)
    _node(store, "n2")
    _lease(store, "L1")
    _lease(store, "L2", node_id="n2")
    g1, g2, g3 = _group(store, "L1", "L1.0"), _group(store, "L1", "L1.1"), _group(store, "L2", "L2.0", "n2")
    with pytest.raises(Exception):  # noqa: B017 - the unique (lease, prompt) constraint, whatever the driver calls it
        _group(store, "L1", "L1.0")

    numbers = iter([0.25, 0.5, 0.75, 0.01, 0.02, 0.03])
    claim = lambda who, limit, now, until: store.write(  # noqa: E731
        lambda tx: verification.claim_pending(tx, who, limit, now, until, lambda: next(numbers)))
    claimed = claim("v1", 2, 100.0, 220.0)
    assert [r.id for r in claimed] == [g1, g2]
    assert (claimed[0].answer, claimed[0].seeds, claimed[0].lease_version) == ("0", [10, 20], 0)
    assert [(r.draw, r.draw_passes, r.draw_held) for r in claimed] == [(0.25, 0, 0), (0.5, 0, 0)]
    assert [r.id for r in claim("v2", 5, 110.0, 230.0)] == [g3]
    assert claim("v2", 5, 120.0, 240.0) == []
    # The node passes checks meanwhile; its groups' claims expire and are claimed again: the same draws, and the
    # node's record as it stood at the first claim, not fresh ones.
    store.write(lambda tx: registry.count_verdicts(tx, "n1", accepted=5, rejected=0, checks=5))
    again = claim("v2", 5, 225.0, 345.0)
    assert [r.id for r in again] == [g1, g2]  # claims expire
    assert [(r.draw, r.draw_passes, r.draw_held, r.node_checks_passed) for r in again] == [
        (0.25, 0, 0, 5), (0.5, 0, 0, 5)]
    assert next(numbers) == 0.01  # nothing was drawn for them again

    accept = lambda gid, rewards: store.write(lambda tx: verification.accept(tx, gid, rewards, now=130.0))  # noqa: E731
    assert accept(g2, [1.0, 0.0]) == 1
    assert accept(g1, [0.5, 0.5]) == 2
    entries = lambda after: store.read(lambda tx: feed.entries_after(tx, after, 10))  # noqa: E731
    assert [r.accepted_seq for r in entries(0)] == [1, 2] and entries(0)[0].rewards == [1.0, 0.0]
    assert [r.accepted_seq for r in entries(1)] == [2]
    assert accept(g1, [0.0, 0.0]) is None  # decided already: no feed position used
    assert store.read(feed.head) == 2

    assert not store.write(lambda tx: verification.reject(tx, g1, "late", now=132.0))  # not pending: no effect
    assert store.read(lambda tx: verification.get_group(tx, g1)).status == "accepted"
    assert store.write(lambda tx: verification.reject_pending_of_node(tx, "n2", "node banned", now=133.0)) == 1
    assert store.read(lambda tx: verification.get_group(tx, g3)).reason == "node banned"
    assert store.read(verification.group_counts) == {"pending": 0, "accepted": 2, "rejected": 1, "held": 0}


def test_hold_and_release_follow_submission_order(store: Store) -> None:
    _node(store)
    _lease(store, "L1", prompts=4)
    ids = [_group(store, "L1", f"L1.{i}") for i in range(4)]
    for gid in ids[:3]:
        assert store.write(lambda tx, gid=gid: verification.hold(tx, gid, [float(gid), 0.0], now=110.0))
    assert not store.write(lambda tx: verification.hold(tx, ids[0], [0.0, 0.0], now=111.0))  # held already
    assert store.read(verification.group_counts)["held"] == 3
    # A check passing on the third group releases only the two held before it.
    assert store.write(lambda tx: verification.release(tx, "n1", ids[2], now=120.0)) == ids[:2]
    assert [(r.accepted_seq, r.rewards[0]) for r in store.read(lambda tx: feed.entries_after(tx, 0, 10))] == [
        (1, float(ids[0])), (2, float(ids[1]))]


def test_counters_are_unique_across_threads(store: Store) -> None:
    with ThreadPoolExecutor(4) as pool:
        seen = list(pool.map(lambda _: store.write(lambda tx: add_to_counter(tx, LEASE_COUNTER)), range(200)))
    assert sorted(seen) == list(range(1, 201))


def test_feed_positions_are_gap_free_and_visible_in_order(store: Store) -> None:
    """A transaction that took a feed position and has not committed yet holds back the next one: a reader never
    sees position p + 1 without p (a sequence would let the later transaction commit first)."""
    _node(store)
    _lease(store, "L1", prompts=2)
    first, second = _group(store, "L1", "L1.0"), _group(store, "L1", "L1.1")
    holding, go, second_done = threading.Event(), threading.Event(), threading.Event()
    got: dict[str, int | None] = {}

    def slow(tx: Tx) -> int | None:
        seq = verification.accept(tx, first, [1.0, 0.0], now=130.0)
        holding.set()
        assert go.wait(timeout=60)  # commit only when the test says so
        return seq

    def fast() -> None:
        got["second"] = store.write(lambda tx: verification.accept(tx, second, [0.0, 1.0], now=131.0))
        second_done.set()

    with ThreadPoolExecutor(2) as pool:
        slow_result = pool.submit(lambda: store.write(slow))
        assert holding.wait(timeout=60)
        fast_result = pool.submit(fast)
        # The second accept cannot commit while the first holds its position (so this wait runs out)...
        assert not second_done.wait(timeout=1.0)
        assert store.read(lambda tx: feed.entries_after(tx, 0, 10)) == []  # ... and nothing is visible yet.
        go.set()
        slow_result.result(timeout=60)
        fast_result.result(timeout=60)
    assert got["second"] == 2
    assert [(r.accepted_seq, r.rewards) for r in store.read(lambda tx: feed.entries_after(tx, 0, 10))] == [
        (1, [1.0, 0.0]), (2, [0.0, 1.0])]


def test_concurrent_accepts_give_every_group_one_position(store: Store) -> None:
    """Four threads accept 60 groups (each one twice, racing) while a reader follows the feed: every group gets
    exactly one position, positions are 1..60, and every read the reader made was gap-free."""
    _node(store)
    _lease(store, "L1", prompts=60)
    ids = [_group(store, "L1", f"L1.{i}") for i in range(60)]
    done = threading.Event()
    gaps: list[list[int]] = []

    def follow() -> int:
        cursor = 0
        while True:
            finished = done.is_set()
            seqs = [r.accepted_seq for r in store.read(lambda tx, c=cursor: feed.entries_after(tx, c, 1000))]
            if seqs != list(range(cursor + 1, cursor + 1 + len(seqs))):
                gaps.append(seqs)
            cursor = seqs[-1] if seqs else cursor
            if finished and not seqs:
                return cursor

    with ThreadPoolExecutor(5) as pool:
        reader = pool.submit(follow)
        results = list(pool.map(lambda gid: store.write(lambda tx: verification.accept(tx, gid, [1.0, 0.0], 1.0)),
                                ids + ids[::-1]))
        done.set()
        assert reader.result(timeout=120) == 60
    assert gaps == []
    assert sorted(r for r in results if r is not None) == list(range(1, 61))
    assert sorted(r.accepted_seq for r in store.read(lambda tx: feed.entries_after(tx, 0, 1000))) == list(range(1, 61))


def test_sources_stay_counted_while_writers_race_to_create_and_empty_their_rows(store: Store) -> None:
    """Eight threads each lease and settle a prompt of one of two sources, 40 times (on PostgreSQL concurrently: a
    source's row is created, added to and emptied under each other's feet): while they run, every committed state
    counts as many sources as it has source rows, and at the end every row is gone."""
    key = {src: (inflight.SOURCE, src, 0, 0) for src in ("a", "b")}
    states: list[tuple[int, int]] = []
    done = threading.Event()

    def churn(i: int) -> None:
        for _ in range(40):
            k = key["ab"[i % 2]]
            store.write(lambda tx, k=k: inflight.apply(tx, {k: 1}))
            store.write(lambda tx, k=k: inflight.apply(tx, {k: -1}))

    def counted(tx: Tx) -> tuple[int, int]:
        rows = tx.execute(text("SELECT cls, n FROM in_flight")).all()
        return (sum(n for c, n in rows if c == inflight.SOURCES), sum(1 for c, _ in rows if c == inflight.SOURCE))

    def watch() -> None:
        while not done.is_set():
            states.append(store.read(counted))

    with ThreadPoolExecutor(9) as pool:
        watcher = pool.submit(watch)
        list(pool.map(churn, range(8)))
        done.set()
        watcher.result(timeout=120)
    assert states and all(sources == rows for sources, rows in states), states
    assert store.read(lambda tx: tx.execute(text("SELECT COUNT(*) FROM in_flight")).scalar_one()) == 0


@needs_pg
def test_connections_the_server_closed_are_replaced_without_a_ping() -> None:
    """No ping before a pooled connection is used: a write or read on a connection the server closed (a restart,
    an operator's kill) runs again on a new one, and a write's effect is applied once."""
    from sqlalchemy import create_engine

    with fresh_database() as url:
        s = Store(url, pool_size=2)
        try:
            assert s.write(lambda tx: add_to_counter(tx, LEASE_COUNTER)) == 1
            killer = create_engine(url)
            with killer.begin() as conn:
                killed = conn.execute(text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE "
                                           "datname = current_database() AND pid <> pg_backend_pid()")).scalar()
            killer.dispose()
            assert killed >= 1  # the pooled connection, and the change listener's
            assert s.write(lambda tx: add_to_counter(tx, LEASE_COUNTER)) == 2
            assert s.read(lambda tx: counter(tx, LEASE_COUNTER)) == 2
        finally:
            s.close()


@needs_pg
def test_a_notifying_write_wakes_long_polls_of_another_process() -> None:
    """Two stores on one PostgreSQL database, as two coordinator processes have: a notifying write through one
    moves the other's change generation (LISTEN/NOTIFY), which its long polls wait on. (SQLite: one process.)"""
    with fresh_database() as url:
        writer, waiter = Store(url), Store(url)
        try:
            waiter.wait_for_change(0, timeout=60)  # its listener is connected (it counts a change when it connects)
            seen = waiter.generation
            writer.write(lambda tx: add_to_counter(tx, LEASE_COUNTER), notify=True)
            waiter.wait_for_change(seen, timeout=60)
            assert waiter.generation != seen
        finally:
            writer.close()
            waiter.close()


def test_state_survives_reopen(store_url: str) -> None:  # noqa: F811
    s = Store(store_url)
    _node(s)
    _lease(s)
    gid = _group(s)
    s.write(lambda tx: verification.accept(tx, gid, [1.0, 1.0], now=120.0))
    signed = SignedManifest.sign(CheckpointManifest(run_id="r", version=3, files=[]), Identity.generate())
    s.write(lambda tx: tx.execute(manifests.insert().values(version=3, signed=signed.model_dump(mode="json"),
                                                            published_at=121.0)))
    s.write(lambda tx: raise_counter(tx, CURRENT_VERSION, 3))
    s.write(lambda tx: status.insert_metrics(tx, 7, 3, {"reward": 0.5}, now=122.0))
    s.close()

    s = Store(store_url)  # the migrations find the database at head: nothing is redone
    try:
        assert _get_node(s) is not None
        assert [r.accepted_seq for r in s.read(lambda tx: feed.entries_after(tx, 0, 10))] == [1]
        assert s.read(lambda tx: get_manifest(tx, 3)) == signed and s.read(lambda tx: get_manifest(tx, 2)) is None
        assert s.read(current_version) == 3 and s.read(lambda tx: latest_manifests(tx, 5)) == [signed]
        assert s.read(lambda tx: status.recent_metrics(tx, 10))[0].data == {"reward": 0.5}
        assert s.write(feed.next_position) == 2  # the feed continues, never reuses a position
        assert s.read(lambda tx: counter(tx, "feed_acked")) == 0
        assert _revision(s) == HEAD
    finally:
        s.close()


@contextmanager
def _database_at(store_url: str, revision: str, down: bool = False) -> Iterator[Connection]:
    """A connection to `store_url`'s database, migrated up (or `down`) to `revision` only, in a transaction committed
    on exit."""
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine

    from swarmrl.coordinator.db.store import MIGRATIONS

    engine = create_engine(store_url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            (command.downgrade if down else command.upgrade)(cfg, revision)
            yield conn
    finally:
        engine.dispose()


def test_a_database_at_revision_0005_is_upgraded(store_url: str) -> None:  # noqa: F811
    """A coordinator's database from before admission (revision 0005: idempotency keys and liveness) upgrades to
    head: its rows stay, nodes get zero lease counters and the source '', the stored challenges go."""
    from sqlalchemy import inspect

    with _database_at(store_url, "0005") as conn:
        conn.execute(text("INSERT INTO nodes (id, public_key, registered_at, last_seen, gone_since) "
                          "VALUES ('n1', 'k1', 1.0, 2.0, 3.0)"))
        conn.execute(text("INSERT INTO leases (id, node_id, policy_version, issued_at, expires_at, sampling) "
                          "VALUES ('L1', 'n1', 0, 1.0, 99.0, '{}')"))
        conn.execute(text("INSERT INTO idempotency_keys VALUES ('n1', 'key-1', 'd', 200, '{}', 1.0)"))
        conn.execute(text("INSERT INTO challenges VALUES ('c', 'k1', 9.0)"))
        assert "challenges" in inspect(conn).get_table_names()

    s = Store(store_url)
    try:
        node = _get_node(s)
        assert node is not None and node.gone_since == 3.0
        assert (node.prompts_leased, node.prompts_abandoned, node.source) == (0, 0, "")
        assert s.write(lambda tx: leasequeries.lock_lease(tx, "L1"))[0].signature is None
        assert s.read(lambda tx: tx.execute(text("SELECT COUNT(*) FROM idempotency_keys")).scalar_one()) == 1
        assert s.read(admission.queued) == 0
        assert _revision(s) == HEAD
        assert "challenges" not in inspect(s.engine).get_table_names()
    finally:
        s.close()


def test_a_database_at_0006_with_open_leases_gets_in_flight_counters(store_url: str) -> None:  # noqa: F811
    """A database from before the in-flight counters (revision 0006) with leases open upgrades to head with
    counters equal to a recount of the open leases (a proven node's, 8 accepted groups, and an unproven one's by
    source), and settling a migrated lease takes back exactly what the migration counted."""
    with _database_at(store_url, "0006") as conn:
        conn.execute(text("INSERT INTO nodes (id, public_key, registered_at, last_seen, groups_accepted, source) "
                          "VALUES ('p', 'kp', 1.0, 2.0, 9, 'a'), ('u', 'ku', 1.0, 2.0, 3, 'b'), "
                          "('v', 'kv', 1.0, 2.0, 0, 'b')"))
        for lease, node, version, state, prompts in [("L1", "p", 0, "open", 2), ("L2", "u", 1, "open", 3),
                                                     ("L3", "v", 0, "open", 1), ("L4", "v", 1, "done", 2)]:
            conn.execute(text(f"INSERT INTO leases (id, node_id, policy_version, issued_at, expires_at, sampling, "
                              f"state) VALUES ('{lease}', '{node}', {version}, 1.0, 99.0, '{{}}', '{state}')"))
            for i in range(prompts):
                conn.execute(text(f"INSERT INTO lease_prompts (lease_id, prompt_id, position, text, answer, seeds, "
                                  f"submitted) VALUES ('{lease}', '{lease}.{i}', {i}, 't', 'a', '[]', "
                                  f"{'TRUE' if state == 'done' else 'FALSE'})"))

    s = Store(store_url)
    try:
        assert _revision(s) == HEAD

        def seen_by(node_id: str, min_version: int):
            return s.read(lambda tx: admission.in_flight(tx, registry.get_node(tx, node_id), min_version))

        assert seen_by("u", 1) == admission.InFlight(own=3, proven=0, unproven=4, unproven_usable=3,
                                                     unproven_same_source=4)
        assert seen_by("p", 0) == admission.InFlight(own=2, proven=2, unproven=4, unproven_usable=4,
                                                     unproven_same_source=0)
        assert seen_by("v", 0).own == 1
        for lease in ("L1", "L2", "L3"):
            assert s.write(lambda tx, lease=lease: admission.settle_lease(tx, lease, now=100.0)) > 0
        assert seen_by("u", 0) == admission.InFlight(0, 0, 0, 0, 0)
        assert s.read(lambda tx: tx.execute(text("SELECT COUNT(*) FROM in_flight")).scalar_one()) == 0
    finally:
        s.close()


def test_a_database_at_0007_keeps_its_nonces_keyed_by_time(store_url: str) -> None:  # noqa: F811
    """The nonces recorded before revision 0008 (keyed by signer and nonce) are still there after it (keyed by time
    first): a replay of those requests is still refused, and pruning by time still works."""
    with _database_at(store_url, "0007") as conn:
        conn.execute(text("INSERT INTO nonces (signer, nonce, ts) VALUES ('a', 'n1', 10.0), ('a', 'n2', 500.0)"))

    s = Store(store_url)
    try:
        assert _revision(s) == HEAD
        assert not s.write(lambda tx: nonces.record_nonce(tx, "a", "n1", 10.0))
        assert s.write(lambda tx: nonces.record_nonce(tx, "b", "n1", 10.0))
        assert s.write(lambda tx: nonces.prune_nonces(tx, older_than=100.0)) == 2
        assert not s.write(lambda tx: nonces.record_nonce(tx, "a", "n2", 500.0))
    finally:
        s.close()


def test_answers_stored_before_0009_stay_through_it_both_ways(store_url: str) -> None:  # noqa: F811
    """The stored answers of revision 0008 (keyed by signer, then key) are still there after 0009 (key first) and
    after a downgrade back to 0008; the key still admits one answer per (key, signer)."""
    from sqlalchemy.exc import IntegrityError

    row = "('n1', 'key-1', 'd', 200, '{\"a\": 1}', 1.0)"
    columns = "(signer, key, digest, status, body, created_at)"
    with _database_at(store_url, "0008") as conn:
        conn.execute(text(f"INSERT INTO idempotency_keys {columns} VALUES {row}, ('n2', 'key-1', 'e', 204, '', 2.0)"))

    def answers(conn: Connection) -> list[tuple]:
        return [tuple(r) for r in conn.execute(text("SELECT signer, key, digest, status, body FROM idempotency_keys "
                                                    "ORDER BY signer"))]

    want = [("n1", "key-1", "d", 200, '{"a": 1}'), ("n2", "key-1", "e", 204, "")]
    s = Store(store_url)
    try:
        assert _revision(s) == HEAD
        assert s.read(answers) == want
        with pytest.raises(IntegrityError):
            s.write(lambda tx: tx.execute(text(f"INSERT INTO idempotency_keys {columns} VALUES {row}")))
    finally:
        s.close()
    with _database_at(store_url, "0008", down=True) as conn:
        assert answers(conn) == want


def test_a_database_at_0009_gets_the_liveness_counters(store_url: str) -> None:  # noqa: F811
    """Revision 0010 adds the feed's read cursor, starting at the acknowledged one (what the trainer has been
    handed is at least what it acknowledged), and the watchdog's last-seen times, at 0 (never); a downgrade removes
    them."""
    from swarmrl.coordinator.db.schema import FEED_READ, TRAINER_SEEN_AT, VERIFIER_SEEN_AT

    with _database_at(store_url, "0009") as conn:
        conn.execute(text("UPDATE kv SET value = 7 WHERE key = 'feed_acked'"))
    s = Store(store_url)
    try:
        assert _revision(s) == HEAD
        assert s.read(lambda tx: (counter(tx, FEED_READ), counter(tx, TRAINER_SEEN_AT),
                                  counter(tx, VERIFIER_SEEN_AT))) == (7, 0, 0)
        assert s.write(lambda tx: feed.trainer_seen(tx, 1000.0, handed=9)) is None
        assert s.read(lambda tx: (feed.read_cursor(tx), counter(tx, TRAINER_SEEN_AT))) == (9, 1000)
    finally:
        s.close()
    with _database_at(store_url, "0009", down=True) as conn:
        keys = {r[0] for r in conn.execute(text("SELECT key FROM kv"))}
        assert "feed_read" not in keys and "trainer_seen_at" not in keys and "feed_acked" in keys


def test_lease_numbers_continue_through_0014_both_ways(store_url: str) -> None:  # noqa: F811
    """Revision 0014 moves PostgreSQL's lease counter to a sequence that continues after the counter row's value
    (SQLite keeps the row), and compresses submitted groups with lz4 there; a downgrade leaves the row at the last
    number handed out."""
    from swarmrl.coordinator.compose import lease_number

    with _database_at(store_url, "0013") as conn:
        conn.execute(text(f"UPDATE kv SET value = 41 WHERE key = '{LEASE_COUNTER}'"))
    s = Store(store_url)
    try:
        assert _revision(s) == HEAD
        assert [s.write(lease_number) for _ in range(3)] == [42, 43, 44]
        if s.dialect == "postgresql":  # submitted groups compressed with lz4 (where the server has it: ours does)
            assert s.read(lambda tx: tx.execute(text(
                "SELECT attcompression FROM pg_attribute WHERE attrelid = 'rollout_groups'::regclass "
                "AND attname = 'payload'")).scalar_one()) == "l"
    finally:
        s.close()
    with _database_at(store_url, "0013", down=True) as conn:
        assert conn.execute(text(f"SELECT value FROM kv WHERE key = '{LEASE_COUNTER}'")).scalar_one() == 44


def test_upgrading_a_store_starts_no_thread(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """`upgrade` (what a coordinator runs before it forks its workers) migrates the database from the calling thread
    and starts none: a thread that has just ended may still hold a native lock (libpq's OpenSSL one) that a forked
    worker would then inherit taken."""

    def refuse(thread: threading.Thread) -> None:
        raise AssertionError(f"thread {thread.name!r} started")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    upgrade(store_url)
    monkeypatch.undo()
    s = Store(store_url)
    try:
        assert _revision(s) == HEAD
    finally:
        s.close()


def test_sources_are_counted_through_0015_both_ways(store_url: str) -> None:  # noqa: F811
    """Revision 0015 merges a source's in-flight rows (one per stripe before it) into one and counts the sources
    holding unproven prompts: a lease request reads the other sources from that count, settling the migrated
    leases takes back exactly what was counted (the table ends empty), and a downgrade restores the rows by
    stripe."""
    nodes_ = [("p", 9, "a"), ("u", 0, "b"), ("v", 0, "b"), ("w", 0, "c")]
    leases_ = [("L1", "p", "proven", "", 2), ("L2", "u", "unproven", "b", 3), ("L3", "v", "unproven", "b", 1),
               ("L4", "w", "unproven", "c", 2)]
    stripes = {node: inflight.stripe(node) for node, _, _ in nodes_}
    assert stripes["u"] != stripes["v"]  # source b had two rows before the revision
    by_stripe = {("b", stripes["u"]): 3, ("b", stripes["v"]): 1, ("c", stripes["w"]): 2}
    with _database_at(store_url, "0014") as conn:
        for node, accepted, source in nodes_:
            conn.execute(text(f"INSERT INTO nodes (id, public_key, registered_at, last_seen, groups_accepted, source) "
                              f"VALUES ('{node}', 'k{node}', 1.0, 2.0, {accepted}, '{source}')"))
        for lease, node, cls, source, n in leases_:
            conn.execute(text(f"INSERT INTO leases (id, node_id, policy_version, issued_at, expires_at, sampling, "
                              f"flight_n, flight_class, flight_source, flight_stripe) VALUES ('{lease}', '{node}', "
                              f"0, 1.0, 99.0, '{{}}', {n}, '{cls}', '{source}', {stripes[node]})"))
            for i in range(n):
                conn.execute(text(f"INSERT INTO lease_prompts (lease_id, prompt_id, position, text, answer, seeds) "
                                  f"VALUES ('{lease}', '{lease}.{i}', {i}, 't', 'a', '[]')"))
        conn.execute(text("INSERT INTO in_flight (cls, source, policy_version, stripe, n) VALUES "
                          + ", ".join(f"('source', '{src}', 0, {st}, {n})" for (src, st), n in by_stripe.items())))

    def source_rows(tx) -> dict[tuple[str, str, int], int]:
        return {(c, src, st): n for c, src, st, n in tx.execute(text(
            "SELECT cls, source, stripe, n FROM in_flight WHERE cls IN ('source', 'sources')"))}

    s = Store(store_url)
    try:
        assert _revision(s) == HEAD
        assert s.read(source_rows) == {("source", "b", 0): 4, ("source", "c", 0): 2,
                                       **{("sources", "", st): n for st, n in Counter(
                                           [inflight.stripe("b"), inflight.stripe("c")]).items()}}
        seen = s.read(lambda tx: admission.in_flight(tx, registry.get_node(tx, "u"), 0))
        assert (seen.unproven_same_source, seen.other_sources) == (4, 1)
        assert s.read(lambda tx: admission.in_flight(tx, registry.get_node(tx, "p"), 0)).other_sources == 2
        s.write(lambda tx: admission.settle_lease(tx, "L4", now=100.0))
        assert s.read(lambda tx: admission.in_flight(tx, registry.get_node(tx, "u"), 0)).other_sources == 0
    finally:
        s.close()
    with _database_at(store_url, "0014", down=True) as conn:
        assert source_rows(conn) == {("source", "b", stripes["u"]): 3, ("source", "b", stripes["v"]): 1}
    s = Store(store_url)
    try:
        for lease in ("L1", "L2", "L3"):
            assert s.write(lambda tx, lease=lease: admission.settle_lease(tx, lease, now=100.0)) > 0
        assert s.read(lambda tx: tx.execute(text("SELECT COUNT(*) FROM in_flight")).scalar_one()) == 0
    finally:
        s.close()


def test_the_migrations_make_what_the_schema_says(store: Store) -> None:
    """The tables the code queries (db/schema.py) are the ones the migrations build: no column, type, index,
    constraint (or, on PostgreSQL, server default) differs. A change to one without the other fails here."""
    postgres = store.dialect == "postgresql"  # Alembic misreads SQLite's '' defaults as changed
    with store.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": postgres})
        assert compare_metadata(context, metadata) == []


def test_a_database_of_the_hand_written_store_is_adopted(tmp_path: Path) -> None:
    """Its rows stay; the counters continue where it left them; its read cursor becomes the acknowledged one."""
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE nodes (id TEXT PRIMARY KEY, public_key TEXT NOT NULL UNIQUE, name TEXT NOT NULL DEFAULT '',
            engine TEXT NOT NULL DEFAULT '', registered_at DOUBLE PRECISION NOT NULL,
            last_seen DOUBLE PRECISION NOT NULL, held_version BIGINT NOT NULL DEFAULT -1,
            banned INTEGER NOT NULL DEFAULT 0, ban_reason TEXT NOT NULL DEFAULT '',
            groups_accepted BIGINT NOT NULL DEFAULT 0, groups_rejected BIGINT NOT NULL DEFAULT 0,
            reputation DOUBLE PRECISION NOT NULL DEFAULT 0.5);
        CREATE TABLE leases (id TEXT PRIMARY KEY, node_id TEXT NOT NULL REFERENCES nodes (id),
            policy_version BIGINT NOT NULL, issued_at DOUBLE PRECISION NOT NULL, expires_at DOUBLE PRECISION NOT NULL,
            sampling TEXT NOT NULL, state TEXT NOT NULL DEFAULT 'open' CHECK (state IN ('open', 'done')));
        CREATE TABLE rollout_groups (id INTEGER PRIMARY KEY AUTOINCREMENT, node_id TEXT NOT NULL REFERENCES nodes (id),
            lease_id TEXT NOT NULL REFERENCES leases (id), prompt_id TEXT NOT NULL, policy_version BIGINT NOT NULL,
            payload TEXT NOT NULL, status TEXT NOT NULL DEFAULT 'pending', reason TEXT NOT NULL DEFAULT '',
            rewards TEXT, claimed_by TEXT, claimed_until DOUBLE PRECISION, accepted_seq BIGINT UNIQUE,
            submitted_at DOUBLE PRECISION NOT NULL, decided_at DOUBLE PRECISION, UNIQUE (lease_id, prompt_id));
        CREATE TABLE kv (key TEXT PRIMARY KEY, value BIGINT NOT NULL);
        INSERT INTO nodes (id, public_key, registered_at, last_seen, banned) VALUES ('n1', 'k1', 1.0, 2.0, 1);
        INSERT INTO leases (id, node_id, policy_version, issued_at, expires_at, sampling)
            VALUES ('L1', 'n1', 4, 1.0, 99.0, '{"group_size": 2}');
        INSERT INTO rollout_groups (node_id, lease_id, prompt_id, policy_version, payload, status, rewards,
            accepted_seq, submitted_at) VALUES
            ('n1', 'L1', 'L1.0', 4, '{"rollouts": [{}, {}]}', 'accepted', '[1.0, 0.0]', 7, 3.0),
            ('n1', 'L1', 'L1.1', 4, '{"rollouts": [{}, {}]}', 'pending', NULL, NULL, 3.0);
        INSERT INTO kv VALUES ('accepted_seq', 7), ('lease_counter', 12), ('current_version', 4),
            ('trainer_cursor', 5);
    """)
    db.commit()
    db.close()

    store = Store(f"sqlite:///{path}")
    try:
        node = _get_node(store)
        assert node is not None and node.banned is True and node.checks_passed == 0 and node.counters_at is None
        assert [(r.accepted_seq, r.rewards) for r in store.read(lambda tx: feed.entries_after(tx, 0, 10))] == [
            (7, [1.0, 0.0])]
        assert store.read(lambda tx: verification.get_group(tx, 2)).held is False
        assert store.read(lambda tx: (counter(tx, "accepted_seq"), counter(tx, LEASE_COUNTER), current_version(tx),
                                      feed.acked(tx), counter(tx, "metrics_reports"))) == (7, 12, 4, 5, 0)
        assert store.write(lambda tx: verification.accept(tx, 2, [0.0, 1.0], now=4.0)) == 8
        assert store.read(lambda tx: tx.execute(text("SELECT COUNT(*) FROM kv WHERE key = 'trainer_cursor'"))
                          .scalar_one()) == 0
    finally:
        store.close()


def test_config_from_toml_with_overrides(tmp_path: Path) -> None:
    op = Identity.generate().public_key_hex
    toml = tmp_path / "coordinator.toml"
    toml.write_text(f'port = 9000\noperator_keys = ["{op.upper()}"]\n\n[run]\nrun_id = "r1"\n\n'
                    "[run.sampling]\ngroup_size = 4\ntemperature = 0.7\n")
    cfg = load_config(CoordinatorConfig, toml, ["run.sampling.group_size=6", f"data_dir={tmp_path / 'd'}"])
    run = cfg.run
    assert (run.run_id, cfg.port, run.sampling.group_size, run.sampling.temperature) == ("r1", 9000, 6, 0.7)
    assert cfg.operator_keys == [op] and cfg.data_dir == tmp_path / "d"
    assert cfg.resolved_key_path == tmp_path / "d" / "coordinator.key"
    assert cfg.resolved_store_url == f"sqlite:///{tmp_path / 'd' / 'coordinator.sqlite'}"
    pg = load_config(CoordinatorConfig, None, ["store_url=postgresql+psycopg://u:p@db:5432/pool"])
    assert pg.resolved_store_url == "postgresql+psycopg://u:p@db:5432/pool"
    assert all(f.description for f in CoordinatorConfig.model_fields.values())
    assert all(f.description for f in SqliteConfig.model_fields.values())


def test_sqlite_settings_are_read_from_their_table(tmp_path: Path) -> None:
    toml = tmp_path / "coordinator.toml"
    toml.write_text("[sqlite]\ngroup_commit = 8\nwriter_process = false\n")
    cfg = load_config(CoordinatorConfig, toml, ["sqlite.request_nice=0"])
    assert (cfg.sqlite.group_commit, cfg.sqlite.writer_process, cfg.sqlite.request_nice) == (8, False, 0)
    assert cfg.sqlite.realtime_committer and cfg.sqlite.writer_commit_interval_ms == 2.0  # the rest: defaults
    with pytest.raises(ConfigError, match="sqlite.group_comit: unknown key; did you mean group_commit"):
        load_config(CoordinatorConfig, None, ["sqlite.group_comit=8"])


@pytest.mark.parametrize(("old", "new"), [
    ("store_group_commit", "group_commit"), ("realtime_committer", "realtime_committer"),
    ("request_nice", "request_nice"), ("store_writer_process", "writer_process"),
    ("store_writer_commit_interval_ms", "writer_commit_interval_ms"),
])
def test_a_sqlite_setting_at_its_old_place_is_refused_with_its_new_one(tmp_path: Path, old: str, new: str) -> None:
    toml = tmp_path / "coordinator.toml"
    toml.write_text(f"port = 9000\n{old} = 1\n")
    for path, overrides in ((toml, []), (None, [f"{old}=1"])):
        with pytest.raises(ConfigError) as refused:
            load_config(CoordinatorConfig, path, overrides)
        line = str(refused.value).splitlines()[-1]
        assert line == f"  (top level): {old} moved: write it as [sqlite] {new}", str(refused.value)


@pytest.mark.parametrize("overrides", [
    ["keep_versions=2", "run.max_staleness=2"],  # verifiers could not fetch the oldest acceptable weights
    ['operator_keys=["abc"]'],
    ["run.task.name=chess"],
    ["nonsense=1"],
    ["run.sampling.group_size=1"],
    ["max_staleness=1"],  # a fact of the run belongs in [run]
    ["store_url=mysql://u:p@db/pool"],
    ["store_url=postgresql://u:p@db/pool"],  # psycopg 3 is the driver: postgresql+psycopg://
])
def test_config_refuses_bad_values(overrides: list[str]) -> None:
    with pytest.raises(ValueError):
        load_config(CoordinatorConfig, None, overrides)


def test_identity_created_private_and_reused(tmp_path: Path) -> None:
    cfg = CoordinatorConfig(data_dir=tmp_path)
    first = cfg.load_identity()
    assert stat.S_IMODE(cfg.resolved_key_path.stat().st_mode) == 0o600
    assert cfg.load_identity().public_key_hex == first.public_key_hex
