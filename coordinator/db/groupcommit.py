"""Group commit for SQLite: the writes that queue up while one commit is being fsynced are committed together, in
one transaction with one fsync, and each caller returns only after that commit.

SQLite takes one writer at a time and a durable commit waits for an fsync of its log (milliseconds on most disks),
so one commit per request caps a coordinator at a few hundred writes per second whatever its CPU. Here the first
caller to find no commit in progress becomes the leader: it takes up to `max_batch` queued writes (its own among
them), runs each in a SAVEPOINT of one transaction, commits, and hands every caller its result; callers that
arrive meanwhile queue for the next leader. Nothing waits for a batch to fill: a write that finds no commit in
progress is committed at once (a batch of one), so batching only ever happens when commits are the bottleneck.

What each write sees and promises is what it would alone: writes run one after another in queue order (a later
one sees the earlier ones' changes, as it would after their commits), a write that raises is rolled back to its
savepoint and gets its exception while the others go on, and a result is handed out only once the commit that
contains it succeeded. When the commit itself fails (a full disk, an I/O error), every write of the batch gets
that error and none of them happened. A batch is durable (synchronous=FULL) when any of its writes asks to be.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Generic, TypeVar

from sqlalchemy import Connection, Engine

T = TypeVar("T")
BEGIN_KEY = "swarmrl_begin"
"""`Connection.info` key naming the statement that begins the connection's next transaction."""


class _Write(Generic[T]):
    __slots__ = ("fn", "durable", "done", "result", "error", "wake", "lead")

    def __init__(self, fn: Callable[[Connection], T], durable: bool):
        self.fn, self.durable = fn, durable
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.wake = threading.Event()  # set when the write is done, or when it is to lead the next commit
        self.lead = False

    def outcome(self) -> T:
        if self.error is not None:
            raise self.error
        return self.result


class GroupCommit:
    """Serializes the writes of one SQLite engine and commits the ones that queue up together.

    Each waiting writer is woken once, by the leader of the commit that holds its write (or to lead the next
    commit), never by every commit: under load dozens of threads wait, and waking them all for each commit
    costs more CPU than the commit."""

    def __init__(self, engine: Engine, max_batch: int, across: AbstractContextManager[Any] | None = None):
        """`across`: held around each commit's transaction, when other processes write to the same database
        (`coordinator.db.shared.WriterLock`)."""
        self.engine, self.max_batch = engine, max(1, max_batch)
        self._across = across if across is not None else nullcontext()
        self._lock = threading.Lock()
        self._queue: list[_Write[Any]] = []
        self._leading = False
        self.batches = 0
        self.writes = 0

    @property
    def queued(self) -> int:
        """Writes waiting for a commit (not counting the ones being committed)."""
        return len(self._queue)

    @property
    def committing(self) -> bool:
        return self._leading

    def run(self, fn: Callable[[Connection], T], durable: bool = True) -> T:
        """`fn(tx)` in the next commit; returns (or raises) once that commit is done."""
        op: _Write[T] = _Write(fn, durable)
        with self._lock:
            self._queue.append(op)
            if not self._leading:  # no commit in progress: the queue holds only this write, which leads
                self._leading = op.lead = True
        while not op.lead:
            op.wake.wait()
            if op.done:
                return op.outcome()
        # Leading: the queue's oldest write is this one, so it is in this batch.
        with self._lock:
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
        try:
            self._commit(batch)
        finally:
            with self._lock:
                self.batches += 1
                self.writes += len(batch)
                for w in batch:
                    w.done = True
                    w.wake.set()
                if self._queue:  # hand the lead to the oldest waiting write
                    self._queue[0].lead = True
                    self._queue[0].wake.set()
                else:
                    self._leading = False
        return op.outcome()

    def _commit(self, batch: list[_Write[Any]]) -> None:
        durable = any(w.durable for w in batch)
        try:
            with self._across, self.engine.connect() as conn:
                raw = conn.connection.dbapi_connection  # pragmas outside SQLAlchemy: no transaction begins for them
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
