"""On SQLite the write-ahead log is copied back into the database by a thread of its own (`WalCheckpointer`), not by
the commit that happens to cross SQLite's threshold while it holds the write lock: writers' own threshold is only a
backstop, and what they commit reaches the database file all the same."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from swarmrl.coordinator.db.schema import LEASE_COUNTER
from swarmrl.coordinator.db.sqlite.shared import WalCheckpointer
from swarmrl.coordinator.db.store import Store, add_to_counter
from swarmrl.testing.waiting import wait_for


def _in_the_database_file(path: Path) -> int:
    """The counter as the database file alone holds it (`immutable`: the log is not read)."""
    conn = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
    try:
        row = conn.execute("SELECT value FROM kv WHERE key = ?", (LEASE_COUNTER,)).fetchone()
        return 0 if row is None else int(row[0])
    except sqlite3.OperationalError:  # not even the tables are there yet
        return 0
    finally:
        conn.close()


def test_commits_reach_the_database_file_without_a_writer_checkpointing(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.sqlite"
    store = Store(f"sqlite:///{path}", group_commit=1)
    try:
        assert store.read(lambda tx: tx.connection.dbapi_connection.execute(
            "PRAGMA wal_autocheckpoint").fetchone()[0]) == WalCheckpointer.WRITER_PAGES
        for _ in range(50):  # each commit far below the writers' threshold
            store.write(lambda tx: add_to_counter(tx, LEASE_COUNTER))
        assert (path.parent / (path.name + "-wal")).stat().st_size > 0
        wait_for(lambda: _in_the_database_file(path) == 50, "the checkpointer to copy the log into the database")
    finally:
        store.close()
