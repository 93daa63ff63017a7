"""One writer process for an SQLite store that several coordinator processes share (`workers` > 1).

On SQLite every write of every process is serialized. With each process committing its own writes in turn
(`coordinator.db.shared.WriterLock`), the lock was held 90-95% of the time under load (bench/RESULTS.md): batches
of about 3.5 writes per process, the lock handed from process to process at every commit, and the holder's
statements waiting for the GIL of its own process, which its request threads hold. Here a process of its own runs
the submissions' writes (the coordinator's hottest, one per submission) in one group commit (`GroupCommit`):
a batch gathers the writes of every server process, and nothing else in the writer competes with its committer.
The other writes still run in the process that serves them, taking their turn at the same lock.

What crosses the socket: a write is named (a handler registered with the writer) and its arguments are plain JSON
data (orjson), as is its outcome: the handler's result, or a refusal that the caller raises as if the write had
run in it (`Refused` and its kinds, `Answered`, a storage failure). No code and no object crosses (no pickle), and
the socket is made mode 0600, in a directory only this user may enter.

What `RemoteWriter.call` promises is `GroupCommit.run`'s: it returns once the commit that holds the write is
durable; an error means nothing of the write was committed. One exception: if the writer goes away with writes in
flight, their callers get `StorageUnavailable` (503) without knowing whether those committed; a retry with the
same Idempotency-Key then gets the answer stored with the write, or applies it once (`coordinator.idempotency`).
The coordinator stops when its writer ends (`coordinator.server`), for its supervisor to restart it whole.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson

from swarmrl.coordinator.auth import Refused, Replayed, StaleSubmission
from swarmrl.coordinator.db.groupcommit import GroupCommit
from swarmrl.coordinator.failures import StorageUnavailable, storage_failure
from swarmrl.coordinator.idempotency import Answer, Answered

log = logging.getLogger("swarmrl.coordinator.db")
_LENGTH = struct.Struct("!I")
_REFUSALS: dict[str, type[Refused]] = {"refused": Refused, "replayed": Replayed, "stale": StaleSubmission}
GONE = "the coordinator's writer process is unavailable (restarting); retry later"

Handler = Callable[..., Callable[[Any], Any]]
"""A named write: `handler(*args)` rebuilds it from its arguments (plain JSON data) before its turn, and returns
the function the commit runs with the transaction, whose result is plain JSON data too."""


def _send(sock: socket.socket, lock: threading.Lock, message: list[Any]) -> None:
    data = orjson.dumps(message)
    with lock:
        sock.sendall(_LENGTH.pack(len(data)) + data)


def _receive(sock: socket.socket) -> list[Any] | None:
    """The next message, or None once the other side has closed the connection."""
    head = _read_exactly(sock, _LENGTH.size)
    body = None if head is None else _read_exactly(sock, _LENGTH.unpack(head)[0])
    return None if body is None else orjson.loads(body)


def _receive_or_none(sock: socket.socket) -> list[Any] | None:
    try:
        return _receive(sock)
    except OSError:  # shut down (`WriterServer.close`) or broken: the same as closed
        return None


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _outcome(error: BaseException | None, result: Any) -> list[Any]:
    """A write's outcome as sent back: ["ok", result], or the refusal or failure the caller raises again."""
    if error is None:
        return ["ok", result]
    if isinstance(error, Answered):
        return ["answered", error.answer.status, error.answer.body.decode()]
    if isinstance(error, Refused):
        kind = next(k for k, cls in reversed(_REFUSALS.items()) if isinstance(error, cls))
        return [kind, error.status, error.reason, error.headers]
    failure = storage_failure(error)
    if failure is not None:
        return ["unavailable", *failure]
    log.error("a write failed in the writer process", exc_info=error)
    return ["error", f"{type(error).__name__}: {error}"]


def _raise(outcome: list[Any]) -> Any:
    kind = outcome[0]
    if kind == "ok":
        return outcome[1]
    if kind == "answered":
        raise Answered(Answer(outcome[1], outcome[2].encode()))
    if kind in _REFUSALS:
        error = _REFUSALS[kind].__new__(_REFUSALS[kind])
        Refused.__init__(error, outcome[1], outcome[2], outcome[3])
        raise error
    if kind == "unavailable":
        raise StorageUnavailable(outcome[1], outcome[2])
    raise RuntimeError(f"the writer process failed a write: {outcome[1]}")


class WriterServer:
    """In the writer process: serves named writes on a Unix socket at `path`, each run in `group`'s next commit
    and answered once that commit is done."""

    def __init__(self, path: str, group: GroupCommit, handlers: dict[str, Handler]):
        self.path, self.group, self.handlers = path, group, handlers
        if os.path.exists(path):  # a socket left by a killed writer: nobody listens on it any more
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(path)
        finally:
            os.umask(old)
        self._sock.listen(64)
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()

    def serve_forever(self) -> None:
        """Accept the server processes' connections, a thread each, until the socket is closed."""
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._conns_lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="writer-connection", daemon=True).start()

    def close(self) -> None:
        """Stop serving: no new connection is taken, and every caller waiting on this writer gets
        StorageUnavailable, as if the process had ended (writes already queued may still commit)."""
        self._sock.close()
        with self._conns_lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:  # closed already
                    pass

    def _serve(self, conn: socket.socket) -> None:
        lock = threading.Lock()
        with conn:
            while (message := _receive_or_none(conn)) is not None:
                call_id, name, args, durable = message

                def done(error: BaseException | None, result: Any, call_id: int = call_id) -> None:
                    try:
                        _send(conn, lock, [call_id, *_outcome(error, result)])
                    except OSError:  # that process is gone: nobody waits for this answer
                        pass

                try:
                    write = self.handlers[name](*args)
                except Exception as e:  # noqa: BLE001 - told to the caller, as a write's own error would be
                    done(e, None)
                    continue
                self.group.submit(write, durable, done)
        with self._conns_lock:
            self._conns.discard(conn)


class RemoteWriter:
    """In a server process: runs named writes in the writer process listening at `path`. Thread-safe: the calls
    of every thread share one connection, each waiting for its own outcome."""

    def __init__(self, path: str, connect_timeout_s: float = 60.0):
        self.path, self.connect_timeout_s = path, connect_timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # connecting, and the table of calls waiting
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[threading.Event, list[Any]]] = {}
        self._gone = False

    def call(self, name: str, args: list[Any], durable: bool = True) -> Any:
        """`name`'s handler run with `args` in the writer's next commit: its result once that commit is done, or
        the refusal it raised; StorageUnavailable (503) when the writer cannot be reached."""
        done, outcome = threading.Event(), []
        with self._lock:
            sock = self._connection()
            call_id = next(self._ids)
            self._waiting[call_id] = (done, outcome)
        try:
            _send(sock, self._send_lock, [call_id, name, args, durable])
        except OSError:
            self._lost(sock)
        done.wait()
        return _raise(outcome)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()

    def _connection(self) -> socket.socket:
        if self._gone:
            raise StorageUnavailable(503, GONE)
        if self._sock is None:
            deadline = time.monotonic() + self.connect_timeout_s
            while True:  # the writer starts beside the server processes: wait for it to listen
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(self.path)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    sock.close()
                    if time.monotonic() > deadline:
                        raise StorageUnavailable(503, GONE) from None
                    time.sleep(0.05)
            self._sock = sock
            threading.Thread(target=self._read, args=(sock,), name="writer-answers", daemon=True).start()
        return self._sock

    def _read(self, sock: socket.socket) -> None:
        try:
            while (message := _receive(sock)) is not None:
                with self._lock:
                    done, outcome = self._waiting.pop(message[0])
                outcome.extend(message[1:])
                done.set()
        except OSError:
            pass
        self._lost(sock)

    def _lost(self, sock: socket.socket) -> None:
        """The writer is gone: every call waiting, and every call from now on, gets StorageUnavailable."""
        with self._lock:
            self._gone = True
            waiting, self._waiting = self._waiting, {}
        sock.close()
        for done, outcome in waiting.values():
            outcome.extend(["unavailable", 503, GONE])
            done.set()
