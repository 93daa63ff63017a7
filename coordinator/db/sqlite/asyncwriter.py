"""The store's writer process, called from a server process's event loop (`coordinator.db.sqlite.writer`).

A request that the writer will write (a prechecked submission, a heartbeat) needs nothing else of the server process
that could block: served on the event loop from start to end, with its write awaited instead of waited for on a
request thread, it costs no hand-off to a thread and back, no wake-up of a thread blocked on the writer's answer, and
no turn at the GIL against the other request threads (`coordinator.pipeline`). One connection per event loop carries
every such write, each answered by its call id.

`RemoteCall` is what an endpoint plans for such a request: the named write and what to make of its result.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from swarmrl.coordinator.db.sqlite.writer import GONE, RemoteWriter, frame, raise_outcome, take_frames
from swarmrl.coordinator.failures import StorageUnavailable
from swarmrl.protocol.refusals import RefusalCode

__all__ = ["AsyncRemoteWriter", "RemoteCall"]


@dataclass(frozen=True)
class RemoteCall:
    """A request's write, to run in the writer process: its handler's `name`, `args` and `durable`, as for
    `RemoteWriter.call`; `finish(result)` makes the request's result of the write's (on the event loop: it must not
    block); `recover(error)`, if set, runs on a request thread when the write raised, before the error is answered
    (what a refusal changes in the database of the server process itself)."""

    name: str
    args: list[Any]
    durable: bool
    finish: Callable[[Any], Any]
    recover: Callable[[BaseException], None] | None = None

    def run(self, writer: RemoteWriter) -> Any:
        """The call made from a request thread, through `writer` (which blocks): the request's result."""
        try:
            return self.finish(writer.call(self.name, self.args, self.durable))
        except Exception as e:
            if self.recover is not None:
                self.recover(e)
            raise

    async def run_async(self, writer: AsyncRemoteWriter, offload: Callable[..., Awaitable[Any]]) -> Any:
        """The call made from the event loop, through `writer`; `recover` runs through `offload` (on a request
        thread). The request's result."""
        try:
            return self.finish(await writer.call(self.name, self.args, self.durable))
        except Exception as e:
            if self.recover is not None:
                await offload(self.recover, e)
            raise


class _Connection(asyncio.Protocol):
    def __init__(self, on_lost: Callable[[], None]):
        self.transport: asyncio.Transport | None = None
        self.waiting: dict[int, asyncio.Future[Any]] = {}
        self._buffer = bytearray()
        self._on_lost = on_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is one without subclassing it

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        for call_id, *outcome in take_frames(self._buffer):
            future = self.waiting.pop(call_id, None)
            if future is not None and not future.done():
                future.set_result(outcome)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost()
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(StorageUnavailable(RefusalCode.UNAVAILABLE, GONE))
        self.waiting.clear()


class AsyncRemoteWriter:
    """In a server process: runs named writes in the writer process listening at `path`, from that process's event
    loop (the one that first calls it). What `call` promises is `RemoteWriter.call`'s."""

    def __init__(self, path: str, connect_timeout_s: float = 60.0):
        self.path, self.connect_timeout_s = path, connect_timeout_s
        self._conn: _Connection | None = None
        self._connecting: asyncio.Lock | None = None
        self._ids = itertools.count()
        self._gone = False

    async def call(self, name: str, args: list[Any], durable: bool = True) -> Any:
        """`name`'s handler run with `args` in the writer's next commit: its result once that commit is done, or
        the refusal it raised; StorageUnavailable (503) when the writer cannot be reached."""
        conn = await self._connection()
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        conn.waiting[call_id] = future
        assert conn.transport is not None
        conn.transport.write(frame([call_id, name, args, durable]))
        try:
            return raise_outcome(await future)
        finally:
            conn.waiting.pop(call_id, None)  # answered, or abandoned (a cancelled request): its answer is dropped

    def close(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()

    async def _connection(self) -> _Connection:
        if self._gone:
            raise StorageUnavailable(RefusalCode.UNAVAILABLE, GONE)
        if self._conn is None:
            if self._connecting is None:
                self._connecting = asyncio.Lock()
            async with self._connecting:
                if self._conn is None:
                    self._conn = await self._connect()
        return self._conn

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout_s
        while True:  # the writer starts beside the server processes: wait for it to listen
            try:
                _, conn = await loop.create_unix_connection(lambda: _Connection(self._lost), self.path)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > deadline:
                    raise StorageUnavailable(RefusalCode.UNAVAILABLE, GONE) from None
                await asyncio.sleep(0.05)
            except OSError:
                raise StorageUnavailable(RefusalCode.UNAVAILABLE, GONE) from None

    def _lost(self) -> None:
        self._gone = True  # as `RemoteWriter`: the writer's end closed, the coordinator is stopping
