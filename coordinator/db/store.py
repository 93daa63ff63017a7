"""The coordinator's database: one SQLAlchemy engine, transactions that are atomic on SQLite and PostgreSQL,
migrations run to head on open, and change notifications for long polls (across processes on PostgreSQL).

    store = Store("sqlite:///runs/coordinator/coordinator.sqlite")     # or postgresql+psycopg://user:pw@host/db
    gid = store.write(lambda tx: ...)          # one transaction, committed before write() returns
    rows = store.read(lambda tx: ...)

What is fsynced, and why. A `write` is durable when it returns (but for the kinds below), and the request it
serves is answered only after that. On SQLite the database runs in WAL mode with `synchronous=FULL`, so each
commit fsyncs the write-ahead log; PostgreSQL does the same with its defaults (`fsync=on`,
`synchronous_commit=on`). NORMAL (fsync only at WAL checkpoints) would survive a crash of the process but not a
power cut, which could take back commits already answered: an accepted submission the node was told was taken
(its compute lost), or a trainer-feed position the trainer has already consumed and saved, which would then be
handed out again for another group that the trainer skips. Accepted work must be neither lost nor counted twice,
so such commits are fsynced; on SQLite the writes that queue up during one fsync share the next one (group
commit, below), which is what lets one disk serve a thousand submissions a second. The log is copied back into the
database file (and that file fsynced) by a thread of its own (`coordinator.db.sqlite.shared.WalCheckpointer`), not
inside the commit of whichever writer takes it past SQLite's threshold. A request's nonce and, with an
Idempotency-Key, its stored answer are written in the transaction of its effect: the three are durable together
or not at all, so a retry after a crash finds the answer exactly when the effect survived.

Four kinds of writes do not wait for their fsync (`write(..., durable=False)`: SQLite synchronous=NORMAL for
that commit, PostgreSQL synchronous_commit=off): the nonce of a refused request, a verifier's claim (with its
stored answer), a heartbeat, and a housekeeping sweep. The log is written in order and the next durable commit
flushes everything before it, so a power cut can take such a write back only together with every commit after
it. A lost nonce then lets its request be replayed only when that request's own effects (none, for a refused
one) were lost too; a lost claim makes its groups claimable again, and a second verdict on a decided group is
ignored; a lost heartbeat loses a liveness time and a share of the node's self-reported idle time, which only
metrics use; a lost sweep is done again by the next one. Nodes send heartbeats more than anything else.

Outside the database: shard files are fsynced (file, then directory) before a publish can commit a manifest that
refers to them (`transfer.store.ShardStore(durable=True)`), and the trainer fsyncs each saved state before renaming
it into place and its step log after each line (`trainer.state`). A full disk fails a write whole (its
transaction rolls back, a shard's temporary file is removed) and is answered 507 (`coordinator.failures`).

Transactions. `write` runs its function in one transaction: on SQLite one writer at a time (BEGIN IMMEDIATE), and
the writes that queue up while a commit is being fsynced are committed together (`coordinator.db.sqlite.groupcommit`:
each in a savepoint of its own, one fsync for all, each answered only after that commit); READ COMMITTED on PostgreSQL,
where the queries take the row locks they need (SELECT ... FOR UPDATE, conditional UPDATE ... RETURNING) and a
deadlock or serialization failure re-runs the whole function (it must have no effects outside the transaction). Any
exception rolls back everything the function did, so a refused request changes nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import orjson
from alembic import command
from alembic.config import Config
from sqlalchemy import BigInteger, Connection, Engine, Row, Table, bindparam, create_engine, event, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import Select

from swarmrl.coordinator.db.fast import Prepared
from swarmrl.coordinator.db.schema import kv
from swarmrl.coordinator.db.sqlite.config import SqliteConfig
from swarmrl.coordinator.db.sqlite.groupcommit import BEGIN_KEY, GroupCommit
from swarmrl.coordinator.db.sqlite.shared import ChangeWatcher, WalCheckpointer, WriterLock

T = TypeVar("T")
Tx = Connection
"""A connection inside a transaction of `Store.write` or `Store.read`."""

log = logging.getLogger("swarmrl.coordinator.db")

MIGRATIONS = Path(__file__).parent / "migrations"
CHANNEL = "swarmrl_changed"
"""PostgreSQL NOTIFY channel: a write that others may be waiting for (a submission, a verdict) was committed."""
MIGRATION_LOCK = 0x5357524C  # "SWRL": the advisory lock that serializes migrations of one PostgreSQL database
RETRIES = 5
_BEGIN = BEGIN_KEY
_NOTIFY = select(func.pg_notify(CHANNEL, ""))
_TRANSIENT_SQLSTATES = {"40001", "40P01"}  # serialization failure, deadlock detected
_SQLITE = SqliteConfig()  # the SQLite settings' defaults


def load(cls: type[T], row: Row[Any]) -> T:
    """A typed row (a dataclass whose fields are columns of `row`) from a result row."""
    mapping = row._mapping
    return cls(**{f.name: mapping[f.name] for f in fields(cls)})  # type: ignore[arg-type]


def insert(tx: Tx | str, table: Table) -> Any:
    """An INSERT for `tx`'s dialect (or the dialect named), with its ON CONFLICT clauses (`on_conflict_do_nothing`,
    `on_conflict_do_update`)."""
    dialect = tx if isinstance(tx, str) else tx.dialect.name
    return (pg_insert if dialect == "postgresql" else sqlite_insert)(table)


# Statements used on every request are built once (building one costs more than running it on SQLite), with
# bind parameters for what varies.
_COUNTER = select(kv.c.value).where(kv.c.key == bindparam("b_key"))
_COUNTER_LOCKED = Prepared(_COUNTER.with_for_update())
_COUNTER = Prepared(_COUNTER)
_ADD = Prepared(update(kv).where(kv.c.key == bindparam("b_key")).values(
    value=kv.c.value + bindparam("b_n", type_=BigInteger)).returning(kv.c.value))
_RAISE = Prepared(update(kv).where(kv.c.key == bindparam("b_key"), kv.c.value < bindparam("b_value", type_=BigInteger)
                                   ).values(value=bindparam("b_value")))


def counter(tx: Tx, key: str, *, lock: bool = False) -> int:
    """The value of counter `key`; with `lock`, its row stays locked until the transaction ends (PostgreSQL)."""
    return int((_COUNTER_LOCKED if lock else _COUNTER).scalar(tx, b_key=key))


def counter_query(key: str) -> Select[tuple[int]]:
    """The select of counter `key`'s value (to read it inside another statement: `counter` reads it alone)."""
    return select(kv.c.value).where(kv.c.key == key)


def add_to_counter(tx: Tx, key: str, n: int = 1) -> int:
    """Add `n` to counter `key` and return its new value. The row stays locked until the transaction ends."""
    return int(_ADD.scalar(tx, b_key=key, b_n=n))


def raise_counter(tx: Tx, key: str, value: int) -> bool:
    """Set counter `key` to `value` if that is larger than its value; whether it was."""
    return _RAISE.rowcount(tx, b_key=key, b_value=value) == 1


def migrate(engine: Engine) -> None:
    """Bring the database up to the newest migration (a no-op when it is there already)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.connect() as conn:
        conn.info[_BEGIN] = "BEGIN IMMEDIATE"
        with conn.begin():
            if conn.dialect.name == "postgresql":
                # Two coordinators starting at once: the second waits here, then finds nothing left to do.
                conn.execute(select(func.pg_advisory_xact_lock(MIGRATION_LOCK)))
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")


class EncodedJSON(str):
    """A value already encoded as JSON text: a JSON column stores it as it is. Lets a large value (a submitted group)
    be encoded before its write transaction, while other writes are not waiting for it."""


def encode_json(obj: Any) -> EncodedJSON:
    """`obj` encoded as a JSON column stores it: to encode a value before its write transaction."""
    return EncodedJSON(orjson.dumps(obj).decode())


def _json_dumps(obj: Any) -> str:
    # JSON columns (a submitted group is kilobytes of numbers) encoded by orjson: exact float round trips, and a
    # tenth of the stdlib's time. Everything stored was validated first (finite floats, 64-bit integers).
    if isinstance(obj, EncodedJSON):
        return str(obj)
    return orjson.dumps(obj).decode()


class Store:
    """One engine over `url`; see the module docstring for what `write` and `read` promise. `group_commit`: on
    SQLite, writes committed together at most (1: one commit per write). `processes`: how many processes of this
    machine open the same SQLite database (`coordinator.db.sqlite.shared`: they take turns at writing, and see each
    other's changes). `realtime_committer`: on SQLite, the thread that commits every write runs under real-time
    scheduling where the process may (`coordinator.db.sqlite.groupcommit.make_realtime`). `commit_interval_s`: on
    SQLite, under load, at most one commit that often (`GroupCommit`'s `min_interval_s`). `committer_thread=False`: on
    SQLite, the thread that owns the store commits its writes (`GroupCommit`'s `threaded`; the writer process's)."""

    def __init__(self, url: str, pool_size: int = 40, group_commit: int = _SQLITE.group_commit, processes: int = 1,
                 realtime_committer: bool = False, commit_interval_s: float = 0.0, committer_thread: bool = True):
        parsed = make_url(url)
        self.dialect = parsed.get_backend_name()
        self._group: GroupCommit | None = None
        self._writer_lock: WriterLock | None = None
        self._watcher: ChangeWatcher | None = None
        self._checkpointer: WalCheckpointer | None = None
        # On SQLite one more connection than asked for: the group commit's committer keeps one.
        self.engine = _engine(url, pool_size + (self.dialect == "sqlite"))
        if self.dialect == "sqlite":
            if processes > 1:
                self._writer_lock = WriterLock(Path(f"{parsed.database}-writer.lock"))
            self._group = GroupCommit(self.engine, group_commit, self._writer_lock, realtime=realtime_committer,
                                      min_interval_s=commit_interval_s, threaded=committer_thread)
        self._changed = threading.Condition()
        self._generation = 0
        migrate(self.engine)
        self._listener = _Listener(self.engine, self._bump) if self.dialect == "postgresql" else None
        if self._writer_lock is not None:
            self._watcher = ChangeWatcher(str(parsed.database), self._bump)
        if self.dialect == "sqlite":
            self._checkpointer = WalCheckpointer(str(parsed.database))

    @property
    def group_commit(self) -> GroupCommit | None:
        """What commits this process's writes on SQLite (None on PostgreSQL)."""
        return self._group

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        if self._listener is not None:
            self._listener.close()
        if self._watcher is not None:
            self._watcher.close()
        if self._checkpointer is not None:
            self._checkpointer.close()
        self.engine.dispose()
        if self._writer_lock is not None:
            self._writer_lock.close()

    # -- transactions ---------------------------------------------------------------------------------

    def write(self, fn: Callable[[Tx], T], *, notify: bool = False, durable: bool = True) -> T:
        """`fn(tx)` in one write transaction, committed before this returns; re-run on a deadlock or serialization
        failure. With `notify`, long polls (here and in other processes) are woken after it.

        `durable=False` (only for what may be lost with a power cut, see the module docstring): the commit does not
        wait for its fsync; the next durable commit, which comes after it in the log, makes it durable too.
        """
        if self._group is not None:
            result = self._group.run(fn, durable)
        else:
            result = self._write_pg(fn, notify, durable)
        if notify:
            self._bump()
        return result

    def _write_pg(self, fn: Callable[[Tx], T], notify: bool, durable: bool) -> T:
        for attempt in range(RETRIES + 1):
            committing = False
            try:
                with self.engine.connect() as conn:
                    with conn.begin():
                        if not durable:
                            conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
                        result = fn(conn)
                        if notify:
                            conn.execute(_NOTIFY)  # delivered at commit
                        committing = True
                return result
            except DBAPIError as e:
                # A connection lost before the commit committed nothing: run it again on another. One lost during
                # the commit may have committed: that is not known, so it is not run again.
                lost = e.connection_invalidated and not committing
                if attempt == RETRIES or not (lost or getattr(e.orig, "sqlstate", None) in _TRANSIENT_SQLSTATES):
                    raise
                log.info("transaction %s; running it again",
                         "lost its connection" if lost else f"conflict ({getattr(e.orig, 'sqlstate', '?')})")
        raise AssertionError("unreachable")

    def read(self, fn: Callable[[Tx], T]) -> T:
        """`fn(tx)` in a read transaction (on SQLite one snapshot; on PostgreSQL each statement sees what was
        committed when it started). It must not write."""
        for attempt in range(RETRIES + 1):
            try:
                with self.engine.connect() as conn:
                    conn.info[_BEGIN] = "BEGIN"
                    with conn.begin():
                        return fn(conn)
            except DBAPIError as e:
                if attempt == RETRIES or not e.connection_invalidated:
                    raise  # a connection lost (the server restarted): read again on another
        raise AssertionError("unreachable")

    # -- change notifications -------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """Moves on after every notifying write (in any process on the same PostgreSQL database; on a SQLite
        database shared by several processes, after any commit)."""
        with self._changed:
            return self._generation

    def wait_for_change(self, seen: int, timeout: float) -> None:
        """Return once `generation` differs from `seen`, or after `timeout` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: self._generation != seen, timeout=timeout)

    def notify(self) -> None:
        """Wake this process's long polls, as a notifying write does: for a write committed elsewhere on its behalf
        (`coordinator.db.sqlite.writer`; other processes hear of it from the database)."""
        self._bump()

    def _bump(self) -> None:
        with self._changed:
            self._generation += 1
            self._changed.notify_all()


def upgrade(url: str) -> None:
    """Bring the database at `url` to the newest migration (`migrate`), from this thread, starting none: a process
    that forks next must have no other thread, not even one that has just ended (`coordinator.server.Workers`)."""
    engine = _engine(url, 1)
    try:
        migrate(engine)
    finally:
        engine.dispose()


def _engine(url: str, pool_size: int) -> Engine:
    """The engine of a store at `url`, its JSON columns encoded by orjson (`_json_dumps`), set up for its dialect."""
    parsed = make_url(url)
    json_args = {"json_serializer": _json_dumps, "json_deserializer": orjson.loads}
    if parsed.get_backend_name() == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise ValueError("an SQLite store needs a file: sqlite:///path/to/coordinator.sqlite")
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, pool_size=pool_size, max_overflow=0, **json_args,
                               connect_args={"timeout": 30.0, "check_same_thread": False})
        event.listen(engine, "connect", _sqlite_connect)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    if parsed.get_backend_name() == "postgresql":
        # No ping before each checkout (a round trip per transaction): a connection the server closed fails its
        # transaction before the commit, and that transaction is run again on a new one (`_write_pg`, `read`).
        return create_engine(parsed, pool_size=pool_size, max_overflow=0, **json_args)
    raise ValueError(f"unsupported store_url {parsed.render_as_string()!r}: use sqlite:///... or "
                     "postgresql+psycopg://...")


def _sqlite_connect(dbapi_conn: Any, _record: Any) -> None:
    # The driver must not begin transactions on its own: `_sqlite_begin` says how each one begins.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")  # see the module docstring
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute(f"PRAGMA wal_autocheckpoint={WalCheckpointer.WRITER_PAGES}")  # a backstop: see WalCheckpointer
    cur.close()


def _sqlite_begin(conn: Connection) -> None:
    # IMMEDIATE takes the write lock at BEGIN: a deferred transaction that writes later could fail to upgrade
    # its read lock (SQLITE_BUSY) instead of waiting for it.
    # On the driver: SQLAlchemy's execution path costs more than SQLite's BEGIN, and a writer holds the lock meanwhile.
    conn.connection.dbapi_connection.execute(conn.info.pop(_BEGIN, "BEGIN IMMEDIATE"))  # type: ignore[union-attr]


class _Listener:
    """LISTENs on CHANNEL over a connection of its own and calls `on_change` for every notification, and once
    after every (re)connection, since notifications sent while it was not listening are lost."""

    def __init__(self, engine: Engine, on_change: Callable[[], None]):
        self._conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._on_change = on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-listener", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import psycopg

        while not self._stop.is_set():
            try:
                with psycopg.connect(self._conninfo, autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self._on_change()
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=1.0):
                            self._on_change()
            except psycopg.Error as e:
                log.warning("change listener lost its connection (%s); reconnecting", e)
                self._stop.wait(1.0)
