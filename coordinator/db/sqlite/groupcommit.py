"""Group commit for SQLite: the writes that queue up while one commit is being made are committed together, in one
transaction with one fsync, and each caller returns only after that commit.

SQLite takes one writer at a time and a durable commit waits for an fsync of its log (milliseconds on most disks),
so one commit per request caps a coordinator at a few hundred writes per second whatever its CPU. Here one thread of
the process (the committer) runs every write, over one connection it keeps open: a caller queues its write and
waits; the committer takes up to `max_batch` queued writes, runs each in a SAVEPOINT of one transaction, commits,
and hands every caller its result. Nothing waits for a batch to fill: a write queued while no commit runs is
committed at once (a batch of one), so batching only ever happens when commits are the bottleneck. One thread, not
whichever caller came first, holds the write lock: it does not wait for a connection from the pool, and no caller's
other work runs on it.

What each write sees and promises is what it would alone: writes run one after another in queue order (a later
one sees the earlier ones' changes, as it would after their commits), a write that raises is rolled back to its
savepoint and gets its exception while the others go on, and a result is handed out only once the commit that
contains it succeeded. When the commit itself fails (a full disk, an I/O error), every write of the batch gets
that error and none of them happened. A batch is durable (synchronous=FULL) when any of its writes asks to be.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Generic, TypeVar

from sqlalchemy import Connection, Engine

T = TypeVar("T")
log = logging.getLogger("swarmrl.coordinator.db")
BEGIN_KEY = "swarmrl_begin"
"""`Connection.info` key naming the statement that begins the connection's next transaction."""


Done = Callable[[BaseException | None, Any], None]
"""Called with a write's outcome, (error, result), once it is known (`GroupCommit.submit`)."""


class _Write(Generic[T]):
    __slots__ = ("fn", "durable", "result", "error", "wake", "done")

    def __init__(self, fn: Callable[[Connection], T], durable: bool, done: Done | None = None):
        self.fn, self.durable, self.done = fn, durable, done
        self.result: Any = None
        self.error: BaseException | None = None
        self.wake = threading.Event() if done is None else None  # set when the write is done, for `run`

    def outcome(self) -> T:
        if self.error is not None:
            raise self.error
        return self.result


class GroupCommit:
    """Serializes the writes of one SQLite engine and commits the ones that queue up together.

    One thread of its own (the committer) runs every write, over one connection it keeps: the callers only queue
    their write and wait for its outcome. The thread that holds SQLite's write lock is then always the same one, and
    a batch is whatever queued while the previous commit ran."""

    def __init__(self, engine: Engine, max_batch: int, across: AbstractContextManager[Any] | None = None,
                 realtime: bool = False, min_interval_s: float = 0.0, sleep: Callable[[float], None] = time.sleep,
                 threaded: bool = True):
        """`across`: held around each commit's transaction, when other processes write to the same database
        (`coordinator.db.sqlite.shared.WriterLock`). `realtime`: run the committer under the real-time FIFO policy where
        the process may (`make_realtime`); `self.realtime` says whether it does. `min_interval_s`: under load, at
        most one commit that often: a write queued sooner after the end of the previous commit waits for the rest
        of the interval, and the writes queued meanwhile join its commit (an idle store commits at once). Fewer,
        larger commits cost less CPU per write (each commit has its own BEGIN, log pages and fsync), for at most
        that much more latency; the writer process uses it (`coordinator.db.sqlite.writer`), where nothing else makes a
        batch wait. `threaded=False`: no committer thread; the thread that owns this object commits what is queued
        when it is due (`due_in`, `commit_due`), the writer process's one thread, which reads the writes too."""
        self.engine, self.max_batch = engine, max(1, max_batch)
        self.min_interval_s, self._sleep = min_interval_s, sleep
        self._last_commit = float("-inf")
        self._across = across if across is not None else nullcontext()
        self._ready = threading.Condition(threading.Lock())
        self._queue: list[_Write[Any]] = []
        self._committing = False
        self._closed = False
        self._conn: Connection | None = None
        self.batches = 0
        self.writes = 0
        self.realtime = False
        self._thread: threading.Thread | None = None
        if threaded:
            # Started now, by the thread that opens the store: it runs at that thread's priority, which request
            # threads started later may run below (`coordinator.server`).
            self._thread = threading.Thread(target=self._commit_queued, name="group-commit", daemon=True)
            self._thread.start()
            self.realtime = realtime and self._thread.native_id is not None and make_realtime(self._thread.native_id)
        self._wants_realtime = realtime and not threaded

    @property
    def queued(self) -> int:
        """Writes waiting for a commit (not counting the ones being committed)."""
        return len(self._queue)

    @property
    def threaded(self) -> bool:
        """Whether a committer thread of its own commits the writes (else its owner does: `commit_due`)."""
        return self._thread is not None

    @property
    def committing(self) -> bool:
        return self._committing

    def run(self, fn: Callable[[Connection], T], durable: bool = True) -> T:
        """`fn(tx)` in the next commit; returns (or raises) once that commit is done (without a committer thread:
        once the owner commits it, from another thread)."""
        op: _Write[T] = _Write(fn, durable)
        self._enqueue(op)
        assert op.wake is not None
        op.wake.wait()
        return op.outcome()

    def submit(self, fn: Callable[[Connection], Any], durable: bool, done: Done) -> None:
        """`fn(tx)` in the next commit, without waiting: `done(error, result)` is called from the committer once
        that commit is done (it must not block; what `run` would raise is its `error`)."""
        self._enqueue(_Write(fn, durable, done))

    def _enqueue(self, op: _Write[Any]) -> None:
        with self._ready:
            if self._closed:
                raise RuntimeError("the store is closed")
            self._queue.append(op)
            self._ready.notify()

    def close(self) -> None:
        """Commit what is queued, then stop the committer and close its connection."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)
            return
        while self._queue:
            self.commit_due()
        with self._ready:  # a commit another thread started (the serving thread's) ends before its connection closes
            while self._committing:
                self._ready.wait(timeout=1.0)
        self._close_connection()

    def due_in(self) -> float | None:
        """Without a committer thread: seconds until the queued writes are due for their commit (0: now), None when
        none is queued."""
        if not self._queue:
            return None
        if len(self._queue) >= self.max_batch or self._closed:
            return 0.0
        return max(0.0, self._last_commit + self.min_interval_s - time.monotonic())

    def commit_due(self) -> None:
        """Without a committer thread: commit the queued writes (up to `max_batch`) now, in the calling thread, and
        hand each its outcome (`done`). The first call runs that thread under real-time scheduling when this
        object was made with `realtime` and the process may (`make_realtime`)."""
        if self._wants_realtime:
            self._wants_realtime = False
            self.realtime = make_realtime(threading.get_native_id())
        with self._ready:
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
            self._committing = True
        self._commit_batch(batch)

    def _commit_queued(self) -> None:
        try:
            while True:
                with self._ready:
                    while not self._queue and not self._closed:
                        self._ready.wait()
                    if not self._queue:
                        return
                    rest = 0.0 if len(self._queue) >= self.max_batch else \
                        self._last_commit + self.min_interval_s - time.monotonic()
                if rest > 0 and not self._closed:  # under load: let more writes join this commit
                    self._sleep(rest)
                with self._ready:
                    batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
                    self._committing = True
                self._commit_batch(batch)
        finally:
            self._close_connection()

    def _commit_batch(self, batch: list[_Write[Any]]) -> None:
        """Commit `batch` (taken off the queue, `_committing` set), then hand each write its outcome."""
        try:
            self._commit(batch)
        finally:
            self._last_commit = time.monotonic()
            with self._ready:
                self._committing = False
                self.batches += 1
                self.writes += len(batch)
                self._ready.notify_all()
            for w in batch:
                if w.done is not None:
                    w.done(w.error, w.result)
                else:
                    assert w.wake is not None
                    w.wake.set()

    def _close_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self.engine.connect()
        return self._conn

    def _commit(self, batch: list[_Write[Any]]) -> None:
        durable = any(w.durable for w in batch)
        try:
            with self._across:
                conn = self._connection()
                raw = conn.connection.dbapi_connection  # pragmas outside SQLAlchemy: no transaction begins for them
                assert raw is not None
                if not durable:
                    raw.execute("PRAGMA synchronous=NORMAL")
                try:
                    conn.info[BEGIN_KEY] = "BEGIN IMMEDIATE"
                    with conn.begin():
                        if len(batch) == 1:  # alone: its exception rolls the whole transaction back
                            self._run_alone(conn, batch[0])
                        else:
                            for w in batch:
                                self._run_in_savepoint(conn, w)
                finally:
                    if not durable:
                        raw.execute("PRAGMA synchronous=FULL")
        except BaseException as e:  # BEGIN or COMMIT failed: nothing of the batch was committed
            if self._conn is not None:  # a fresh connection for the next batch, whatever state this one is in
                self._conn.invalidate()
                self._conn.close()
                self._conn = None
            for w in batch:
                if w.error is None:
                    w.result, w.error = None, e

    @staticmethod
    def _run_alone(conn: Connection, w: _Write[Any]) -> None:
        try:
            w.result = w.fn(conn)
        except BaseException as e:
            w.error = e
            raise

    @staticmethod
    def _run_in_savepoint(conn: Connection, w: _Write[Any]) -> None:
        # On the driver directly: SQLAlchemy's nested transaction objects cost more than SQLite's savepoints.
        raw = conn.connection.dbapi_connection
        assert raw is not None
        raw.execute("SAVEPOINT batched_write")
        try:
            w.result = w.fn(conn)
        except BaseException as e:
            w.error = e
            # Raises when SQLite ended the whole transaction (e.g. a full disk): then the batch fails as a whole.
            raw.execute("ROLLBACK TO batched_write")
        raw.execute("RELEASE batched_write")


def make_realtime(thread_id: int) -> bool:
    """Run the thread `thread_id` (a native id) under the real-time FIFO policy at its lowest priority, if this
    process may (Linux with CAP_SYS_NICE: root, or a container granted it); whether it now does.

    Why the committer: every write of every process waits for the one thread that holds the write lock, and on a
    machine whose cores are all busy it was often runnable but waiting for a core while holding it (a quarter of
    its hold, measured: bench/RESULTS.md). A real-time thread takes a core the moment it can run. It runs only to
    commit queued writes, and the kernel's real-time throttling leaves other threads a share of every core even
    if it never stopped."""
    try:
        os.sched_setscheduler(thread_id, os.SCHED_FIFO, os.sched_param(os.sched_get_priority_min(os.SCHED_FIFO)))
    except (OSError, AttributeError) as e:  # not permitted here, or not Linux: it runs as any thread does
        log.info("the store's committer runs at normal priority (real-time FIFO not permitted: %s)", e)
        return False
    log.info("the store's committer runs under real-time FIFO scheduling")
    return True
