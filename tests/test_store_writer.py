"""The store's writer process (`coordinator.db.sqlite.writer`), its socket protocol tested in one process: a named write
runs in the writer's group commit and its caller returns once that commit is done; refusals, stored answers and
storage failures reach the caller as the same exceptions, and the write is rolled back; writes sent over several
connections (several server processes) share commits; and when the writer goes away, every caller waiting on it
gets a 503 instead of waiting for ever. The whole coordinator with its writer process is tested in
`tests/test_coordinator_workers.py`."""

from __future__ import annotations

import asyncio
import errno
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from swarmrl.coordinator.auth import Refused, Replayed, StaleSubmission
from swarmrl.coordinator.db.schema import kv
from swarmrl.coordinator.db.sqlite.asyncwriter import AsyncRemoteWriter
from swarmrl.coordinator.db.sqlite.writer import GONE, RemoteWriter, WriterServer
from swarmrl.coordinator.db.store import Store, Tx
from swarmrl.coordinator.failures import DISK_FULL, StorageUnavailable, refusal_of
from swarmrl.coordinator.idempotency import Answer, Answered
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.testing.waiting import wait_for


class Writer:
    """A store, a writer serving it from a thread, and a way to hold its committer inside a write."""

    def __init__(self, tmp_path: Path, committer_thread: bool):
        self.db = tmp_path / "c.sqlite"
        self.store = Store(f"sqlite:///{self.db}", committer_thread=committer_thread)
        assert self.store.group_commit is not None
        self.group = self.store.group_commit
        self.path = str(tmp_path / "writer.sock")
        self.release = threading.Event()
        self.server = WriterServer(self.path, self.group, {"put": self._put, "hold": self._hold, "fail": self._fail})
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        self._before = set(self._rows())

    @staticmethod
    def _put(key: str, value: int) -> Callable[[Tx], Any]:
        def write(tx: Tx) -> list[Any]:
            tx.execute(kv.insert().values(key=key, value=value))
            return [key, value]
        return write

    def _hold(self) -> Callable[[Tx], Any]:
        def write(tx: Tx) -> str:
            self.release.wait(60)
            return "held"
        return write

    @staticmethod
    def _fail(key: str, kind: str) -> Callable[[Tx], Any]:
        errors: dict[str, BaseException] = {
            "refused": Refused(RefusalCode.RATE_LIMITED, "slow down", retry_after=2.0), "replayed": Replayed(),
            "stale": StaleSubmission("2 versions behind"), "answered": Answered(Answer(200, b'{"ok":true}')),
            "disk": OSError(errno.ENOSPC, "No space left on device"), "bug": KeyError("oops")}

        def write(tx: Tx) -> None:
            tx.execute(kv.insert().values(key=key, value=1))  # rolled back with the write
            raise errors[kind]
        return write

    def _rows(self) -> dict[str, int]:
        with sqlite3.connect(self.db) as conn:  # another connection: sees only what was committed
            return dict(conn.execute("SELECT key, value FROM kv").fetchall())

    def stored(self) -> dict[str, int]:
        """The rows the test's writes committed (the store's own counters left out)."""
        return {k: v for k, v in self._rows().items() if k not in self._before}

    def close(self) -> None:
        self.release.set()
        self.server.close()
        self.store.close()


@pytest.fixture(params=[False, True], ids=["one-thread", "committer-thread"])
def writer(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Writer]:
    """A writer whose serving thread commits the writes (as the writer process runs), or one that hands them to the
    group commit's own committer thread."""
    w = Writer(tmp_path, request.param)
    yield w
    w.close()


def test_a_write_is_committed_before_its_caller_returns(writer: Writer) -> None:
    remote = RemoteWriter(writer.path)
    assert remote.call("put", ["a", 1]) == ["a", 1]
    assert writer.stored() == {"a": 1}
    remote.close()


@pytest.mark.parametrize("kind", ["refused", "replayed", "stale", "answered", "disk", "bug"])
def test_a_refused_write_raises_the_same_in_its_caller_and_is_rolled_back(writer: Writer, kind: str) -> None:
    remote = RemoteWriter(writer.path)
    with pytest.raises(Exception) as raised:
        remote.call("fail", ["x", kind])
    e = raised.value
    if kind == "refused":
        assert type(e) is Refused and (e.code, e.status, e.reason, e.headers) == (
            RefusalCode.RATE_LIMITED, 429, "slow down", {"Retry-After": "2"})
    elif kind == "replayed":
        assert type(e) is Replayed and (e.code, e.status) == (RefusalCode.REPLAYED, 409)
    elif kind == "stale":
        assert type(e) is StaleSubmission and e.code is RefusalCode.STALE_SUBMISSION
        assert e.reason.endswith("2 versions behind")
    elif kind == "answered":
        assert type(e) is Answered and e.answer == Answer(200, b'{"ok":true}')
    elif kind == "disk":  # a storage failure: the caller answers 507 with the reason, as if it had happened there
        assert type(e) is StorageUnavailable and refusal_of(e, "test")[:2] == (RefusalCode.DISK_FULL, DISK_FULL)
        assert e.status == 507
    else:  # a bug in the write: a 500 in the caller (the writer logs it)
        assert type(e) is RuntimeError and "KeyError" in str(e)
    assert writer.stored() == {}
    assert remote.call("put", ["after", 2]) == ["after", 2]  # the connection is still usable
    remote.close()


def test_writes_from_several_processes_share_a_commit(writer: Writer) -> None:
    remotes = [RemoteWriter(writer.path) for _ in range(2)]
    connected, go = threading.Barrier(7), threading.Event()

    def caller(i: int) -> None:  # a request thread: its own connection, made (and accepted) before the hold
        remotes[i % 2].call("put", [f"w{i}", i])
        connected.wait(60)
        go.wait(60)
        remotes[i % 2].call("put", [f"k{i}", i])

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(6)]
    for t in callers:
        t.start()
    connected.wait(60)
    holder = threading.Thread(target=lambda: remotes[0].call("hold", []))
    holder.start()
    wait_for(lambda: writer.group.committing, "the held write to commit")
    batches = writer.group.batches
    go.set()
    if writer.group.threaded:
        wait_for(lambda: writer.group.queued == 6, "six writes queued behind the held one")
    else:  # the thread that reads them is inside the held commit: they wait in its connections
        frame = 4 + len(orjson.dumps([1, "put", ["k0", 0], True]))  # each call id and i here is one digit
        wait_for(lambda: writer.server.unread() == 6 * frame, "six writes sent behind the held one")
    writer.release.set()
    for t in [holder, *callers]:
        t.join(60)
    assert writer.stored() == {**{f"w{i}": i for i in range(6)}, **{f"k{i}": i for i in range(6)}}
    assert writer.group.batches == batches + 2  # the held write's, then one for all six
    for r in remotes:
        r.close()


def test_callers_get_a_503_when_the_writer_goes_away(writer: Writer) -> None:
    remote = RemoteWriter(writer.path)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            remote.call("hold", [])
        except StorageUnavailable as e:
            outcome.append(e)

    waiting = threading.Thread(target=call)
    waiting.start()
    wait_for(lambda: writer.group.committing, "the held write to commit")
    writer.server.close()  # as the writer process ending
    waiting.join(60)
    assert [(e.status, e.reason) for e in outcome] == [(503, GONE)]
    with pytest.raises(StorageUnavailable):  # and every call after it, at once
        remote.call("put", ["late", 1])


def test_the_event_loops_client_gets_what_a_threads_client_gets(writer: Writer) -> None:
    """`AsyncRemoteWriter` (a server process's event loop): the result once committed, the same refusals, several
    calls in flight on its one connection answered each by its id, and a 503 for the calls waiting when the writer
    goes away and for every call after."""

    async def main() -> None:
        remote = AsyncRemoteWriter(writer.path)
        assert await remote.call("put", ["a", 1]) == ["a", 1]
        with pytest.raises(StaleSubmission):
            await remote.call("fail", ["x", "stale"])
        assert await asyncio.gather(*(remote.call("put", [f"k{i}", i]) for i in range(5))) == [
            [f"k{i}", i] for i in range(5)]
        held = asyncio.ensure_future(remote.call("hold", []))
        await asyncio.to_thread(wait_for, lambda: writer.group.committing, "the held write to commit")
        writer.server.close()  # as the writer process ending
        with pytest.raises(StorageUnavailable) as gone:
            await held
        assert (gone.value.status, gone.value.reason) == (503, GONE)
        with pytest.raises(StorageUnavailable):
            await remote.call("put", ["late", 1])

    asyncio.run(main())
    assert writer.stored() == {"a": 1, **{f"k{i}": i for i in range(5)}}
