"""One SQLite database shared by several coordinator processes on one machine (`workers` > 1).

SQLite lets one writer in at a time across processes, but a process that finds the database locked sleeps and
tries again (after 1, 2, 5, 10, ... ms). Under load the process that has just committed takes the lock again long
before the sleeper wakes, so the sleeper's writes wait tens of milliseconds, and longer each time. `WriterLock`
puts a blocking `flock` in front of every write transaction instead: the kernel wakes the waiting process the moment
the lock is free, so the processes take turns, and SQLite's own lock is then always free when a writer asks.

Long polls wait for the store to change; a commit in another process does not wake them by itself. `ChangeWatcher`
asks SQLite whether anyone committed (`PRAGMA data_version`, which moves with every commit made through another
connection) a few times a second, and says so.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

log = logging.getLogger("swarmrl.coordinator.db")


class WriterLock:
    """An exclusive lock across processes (`flock` on `path`, made if missing), held around each write transaction.
    Within a process only one thread asks at a time (the group commit's committer)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> WriterLock:
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # blocks without the GIL
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)


class _SqlitePoller:
    """Calls `_poll()` every `interval_s`, from a thread of its own, over an SQLite connection of its own to `path`,
    until `close()`. A subclass sets up what `_poll` needs, then calls `_start()`."""

    def __init__(self, path: str, interval_s: float, name: str, **connect: float):
        self.path, self.interval_s = path, interval_s
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, **connect)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _poll(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                self._poll()
        finally:
            self._conn.close()


class ChangeWatcher(_SqlitePoller):
    """Calls `on_change` within about `interval_s` of any commit to the SQLite database at `path` (by any process,
    this one included), from a thread of its own."""

    def __init__(self, path: str, on_change: Callable[[], None], interval_s: float = 0.05):
        super().__init__(path, interval_s, "store-watcher")
        self._on_change = on_change
        self._seen = self._version()  # now: a commit made after this returns is never taken for the start
        self._start()

    def _version(self) -> int:
        return int(self._conn.execute("PRAGMA data_version").fetchone()[0])

    def _poll(self) -> None:
        try:
            version = self._version()
        except sqlite3.Error as e:  # a busy or failing disk: long polls still time out on their own
            log.warning("could not read the store's data version: %s", e)
            return
        if version != self._seen:
            self._seen = version
            self._on_change()


class WalCheckpointer(_SqlitePoller):
    """Copies an SQLite database's write-ahead log back into it from a thread of its own, every `interval_s`
    (`PRAGMA wal_checkpoint(PASSIVE)`), so that writers need not.

    SQLite's automatic checkpoint runs inside the commit that takes the log past its threshold, while that commit
    holds the write lock: every other write (in every process) waits for a copy of thousands of pages and an fsync
    of the database file. Here the writers' threshold is raised to `WRITER_PAGES` (a backstop, should this thread
    fall behind) and the copying is done aside: a PASSIVE checkpoint never waits for a reader or a writer, copies
    what it can, and leaves the rest to the next one; once the whole log is copied, the next writer starts it over,
    so it stays a few seconds of writes long."""

    WRITER_PAGES = 20000
    """The writers' own threshold (`PRAGMA wal_autocheckpoint`), in pages of the log."""

    def __init__(self, path: str, interval_s: float = 0.5):
        super().__init__(path, interval_s, "wal-checkpoint", timeout=0.1)
        self._start()

    def _poll(self) -> None:
        try:
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as e:  # busy (another process's checkpoint), or a failing disk: next time
            log.debug("WAL checkpoint skipped: %s", e)
