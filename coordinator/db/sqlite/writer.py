"""One writer process for an SQLite store that several coordinator processes share (`workers` > 1).

On SQLite every write of every process is serialized. With each process committing its own writes in turn
(`coordinator.db.sqlite.shared.WriterLock`), the lock was held 90-95% of the time under load (bench/RESULTS.md): batches
of about 3.5 writes per process, the lock handed from process to process at every commit, and the holder's
statements waiting for the GIL of its own process, which its request threads hold. Here a process of its own runs
the coordinator's hottest writes, the submissions' and the heartbeats', in one group commit (`GroupCommit`), its
commits paced under load so that each gathers several: a batch holds the writes of every server process, and
nothing else in the writer competes with its committer. The other writes still run in the process that serves
them, taking their turn at the same lock.

What crosses the socket: a write is named (a handler registered with the writer) and its arguments are plain JSON
data (orjson), as is its outcome: the handler's result, or a refusal that the caller raises as if the write had
run in it (`Refused` and its kinds, with their `RefusalCode`; `Answered`; a storage failure, with its code). No
program and no object crosses (no pickle), and the socket is made mode 0600, in a directory only this user may
enter.

What `RemoteWriter.call` promises is `GroupCommit.run`'s: it returns once the commit that holds the write is
durable; an error means nothing of the write was committed. One exception: if the writer goes away with writes in
flight, their callers get `StorageUnavailable` (503) without knowing whether those committed; a retry with the
same Idempotency-Key then gets the answer stored with the write, or applies it once (`coordinator.idempotency`).
The coordinator stops when its writer ends (`coordinator.server`), for its supervisor to restart it whole.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import selectors
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson

from swarmrl.coordinator.auth import Refused, Replayed, StaleSubmission
from swarmrl.coordinator.db.sqlite.groupcommit import GroupCommit
from swarmrl.coordinator.failures import StorageUnavailable, storage_failure
from swarmrl.coordinator.idempotency import Answer, Answered
from swarmrl.protocol.refusals import RefusalCode

log = logging.getLogger("swarmrl.coordinator.db")
_LENGTH = struct.Struct("!I")
_REFUSALS: dict[str, type[Refused]] = {"refused": Refused, "replayed": Replayed, "stale": StaleSubmission}
GONE = "the coordinator's writer process is unavailable (restarting); retry later"

Handler = Callable[..., Callable[[Any], Any]]
"""A named write: `handler(*args)` rebuilds it from its arguments (plain JSON data) before its turn, and returns
the function the commit runs with the transaction, whose result is plain JSON data too."""


class _Channel:
    """A request thread's connection to the writer (`RemoteWriter`): framed messages (`frame`) sent, and read
    through a buffer (a frame usually costs one system call)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._reader = sock.makefile("rb", buffering=1 << 16)

    def send(self, message: list[Any]) -> None:
        self.sock.sendall(frame(message))

    def receive(self) -> list[Any] | None:
        """The next message, or None once the connection is closed, shut down or broken."""
        try:
            head = self._reader.read(_LENGTH.size)
            if len(head) < _LENGTH.size:
                return None
            size = _LENGTH.unpack(head)[0]
            body = self._reader.read(size)
        except OSError:
            return None
        return orjson.loads(body) if len(body) == size else None

    def shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed already
            pass

    def close(self) -> None:
        self._reader.close()
        self.sock.close()


def _outcome(error: BaseException | None, result: Any) -> list[Any]:
    """A write's outcome as sent back: ["ok", result], or the refusal or failure the caller raises again."""
    if error is None:
        return ["ok", result]
    if isinstance(error, Answered):
        return ["answered", error.answer.status, error.answer.body.decode()]
    if isinstance(error, Refused):
        kind = next(k for k, cls in reversed(_REFUSALS.items()) if isinstance(error, cls))
        return [kind, error.code.value, error.reason, error.headers]
    failure = storage_failure(error)
    if failure is not None:
        return ["unavailable", failure[0].value, failure[1]]
    log.error("a write failed in the writer process", exc_info=error)
    return ["error", f"{type(error).__name__}: {error}"]


def raise_outcome(outcome: list[Any]) -> Any:
    """The result of a write's outcome as `_outcome` sent it, or the refusal or failure it says, raised."""
    kind = outcome[0]
    if kind == "ok":
        return outcome[1]
    if kind == "answered":
        raise Answered(Answer(outcome[1], outcome[2].encode()))
    if kind in _REFUSALS:
        error = _REFUSALS[kind].__new__(_REFUSALS[kind])
        Refused.__init__(error, RefusalCode(outcome[1]), outcome[2], outcome[3])
        raise error
    if kind == "unavailable":
        raise StorageUnavailable(RefusalCode(outcome[1]), outcome[2])
    raise RuntimeError(f"the writer process failed a write: {outcome[1]}")


def take_frames(buffer: bytearray) -> list[Any]:
    """The messages of the whole frames at the front of `buffer`, taken off it (a partial frame stays)."""
    out, at = [], 0
    while len(buffer) - at >= _LENGTH.size:
        size = _LENGTH.unpack_from(buffer, at)[0]
        if len(buffer) - at - _LENGTH.size < size:
            break
        out.append(orjson.loads(memoryview(buffer)[at + _LENGTH.size: at + _LENGTH.size + size]))
        at += _LENGTH.size + size
    if at:
        del buffer[:at]
    return out


def frame(message: list[Any]) -> bytes:
    """`message` as it crosses: its length, then its orjson."""
    data = orjson.dumps(message)
    return _LENGTH.pack(len(data)) + data


class _Inbound:
    """The writer's end of one connection: the bytes read so far (whole frames are taken off the front), and a lock
    for sending answers (a group commit with a committer thread sends them from it)."""

    __slots__ = ("sock", "buffer", "send_lock")

    def __init__(self, sock: socket.socket):
        self.sock, self.buffer, self.send_lock = sock, bytearray(), threading.Lock()

    def send(self, message: list[Any]) -> None:
        data = frame(message)
        with self.send_lock:
            self.sock.sendall(data)

    def unread(self) -> int:
        """Bytes received and not read yet."""
        try:
            return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:  # closed
            return 0

    def shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed already
            pass


class WriterServer:
    """In the writer process: serves named writes on a Unix socket at `path`, each run in `group`'s next commit
    and answered once that commit is done.

    One thread does it all: it reads every connection (one per request thread of each server process) as it becomes
    readable, rebuilds each write, commits the writes queued when their commit is due (`GroupCommit.due_in`, when
    `group` has no committer thread of its own) and sends each answer. A thread per connection and a committer beside
    them cost a wake-up and a turn at the GIL per write, and a hand-off per commit (bench/RESULTS.md); here one
    wake-up reads whatever arrived on every connection meanwhile, and nothing else in the process competes with the
    commits."""

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
        self._sock.listen(256)
        self._sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()  # `close` wakes the loop through it
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._inbound: set[_Inbound] = set()
        self._lock = threading.Lock()  # `_inbound`, which `close` reads from another thread
        self._closed = False

    def serve_forever(self) -> None:
        """Accept connections and serve their writes until `close`."""
        drive = not self.group.threaded
        try:
            while not self._closed:
                for key, _ in self._selector.select(self.group.due_in() if drive else None):
                    if key.fileobj is self._sock:
                        self._accept()
                    elif key.fileobj is not self._wake_r:
                        self._read(key.data)
                if drive and self.group.due_in() == 0:
                    self.group.commit_due()
        finally:
            for key in list(self._selector.get_map().values()):
                if isinstance(key.data, _Inbound):
                    self._drop(key.data)
            self._selector.close()
            self._sock.close()
            self._wake_r.close()
            self._wake_w.close()

    def close(self) -> None:
        """Stop serving: no new connection is taken, and every caller waiting on this writer gets
        StorageUnavailable, as if the process had ended (writes already queued may still commit)."""
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:  # the loop has ended already
            pass
        with self._lock:  # now, even while the loop is inside a commit
            for inbound in self._inbound:
                inbound.shutdown()

    def unread(self) -> int:
        """Bytes that reached this writer's connections and are not read yet (the next turn of its loop reads
        them)."""
        with self._lock:
            return sum(inbound.unread() for inbound in self._inbound)

    def _accept(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(True)  # read only when readable; answers are sent whole
        inbound = _Inbound(conn)
        with self._lock:
            self._inbound.add(inbound)
        self._selector.register(conn, selectors.EVENT_READ, inbound)

    def _drop(self, inbound: _Inbound) -> None:
        self._selector.unregister(inbound.sock)
        with self._lock:
            self._inbound.discard(inbound)
        inbound.shutdown()
        inbound.sock.close()

    def _read(self, inbound: _Inbound) -> None:
        try:
            data = inbound.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:  # that process is gone, or closed this connection
            self._drop(inbound)
            return
        inbound.buffer += data
        for call_id, name, args, durable in take_frames(inbound.buffer):
            self._submit(inbound, call_id, name, args, durable)

    def _submit(self, inbound: _Inbound, call_id: int, name: str, args: list[Any], durable: bool) -> None:
        def done(error: BaseException | None, result: Any) -> None:
            try:
                inbound.send([call_id, *_outcome(error, result)])
            except OSError:  # that process is gone: nobody waits for this answer
                pass

        try:
            write = self.handlers[name](*args)
        except Exception as e:  # noqa: BLE001 - told to the caller, as a write's own error would be
            done(e, None)
            return
        self.group.submit(write, durable, done)


class RemoteWriter:
    """In a server process: runs named writes in the writer process listening at `path`. Thread-safe: each thread
    has a connection of its own, on which it sends a write and waits for its outcome (no other thread in between)."""

    def __init__(self, path: str, connect_timeout_s: float = 60.0):
        self.path, self.connect_timeout_s = path, connect_timeout_s
        self._local = threading.local()
        self._channels: list[_Channel] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._gone = False

    def call(self, name: str, args: list[Any], durable: bool = True) -> Any:
        """`name`'s handler run with `args` in the writer's next commit: its result once that commit is done, or
        the refusal it raised; StorageUnavailable (503) when the writer cannot be reached."""
        channel = self._channel()
        call_id = next(self._ids)
        try:
            channel.send([call_id, name, args, durable])
        except OSError:
            pass  # the answer will not come either: told below
        answer = channel.receive()
        if answer is None:
            self._gone = True  # every thread's connection is to the same process
            raise StorageUnavailable(RefusalCode.UNAVAILABLE, GONE)
        assert answer[0] == call_id, "answers come in the order of the calls on one connection"
        return raise_outcome(answer[1:])

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                channel.shutdown()
                channel.close()

    def _channel(self) -> _Channel:
        if self._gone:
            raise StorageUnavailable(RefusalCode.UNAVAILABLE, GONE)
        channel: _Channel | None = getattr(self._local, "channel", None)
        if channel is None:
            deadline = time.monotonic() + self.connect_timeout_s
            while True:  # the writer starts beside the server processes: wait for it to listen
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(self.path)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    sock.close()
                    if time.monotonic() > deadline:
                        raise StorageUnavailable(RefusalCode.UNAVAILABLE, GONE) from None
                    time.sleep(0.05)
            channel = self._local.channel = _Channel(sock)
            with self._lock:
                self._channels.append(channel)
        return channel
