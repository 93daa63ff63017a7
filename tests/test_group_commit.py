"""Group commit on SQLite (`coordinator.db.sqlite.groupcommit`): writes that queue behind a commit share the next one;
each write still behaves as if alone (a failing one is rolled back by itself, later ones see earlier ones), and no
write returns before the commit holding it succeeded: when that commit fails, every write of the batch fails and
none of it is stored. Batches are made deterministic by holding the first write until the others have queued."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from swarmrl.coordinator.auth import Refused
from swarmrl.coordinator.db.schema import kv, leases
from swarmrl.coordinator.db.sqlite.groupcommit import GroupCommit, make_realtime
from swarmrl.coordinator.db.store import Store, Tx, add_to_counter, counter
from swarmrl.coordinator.server import lower_request_priority
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.testing.waiting import wait_for


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'c.sqlite'}", group_commit=64)
    yield s
    s.close()


def _queued(store: Store, n: int) -> None:
    """Wait until `n` writes wait in the queue behind the running commit."""
    group = store._group
    assert group is not None
    wait_for(lambda: group.queued >= n, f"{n} queued writes")


def _behind_a_held_write(store: Store, writes: list) -> list:
    """Run `writes` from threads of their own while a first write holds the commit; their outcomes (result or
    exception), in order."""
    release = threading.Event()
    holder = threading.Thread(target=lambda: store.write(lambda tx: release.wait(30)))
    holder.start()
    wait_for(lambda: store._group is not None and store._group.committing, "the held write to lead")
    outcomes: list = [None] * len(writes)

    def run(i: int) -> None:
        try:
            outcomes[i] = store.write(writes[i])
        except Exception as e:  # the outcome under test
            outcomes[i] = e

    threads = []
    for i in range(len(writes)):  # one at a time, so that the queue order is the list order
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        _queued(store, i + 1)
    release.set()
    for t in [holder, *threads]:
        t.join(timeout=60)
    return outcomes


def test_queued_writes_share_one_commit_and_fail_alone(store: Store) -> None:
    def refuse(tx: Tx) -> None:
        add_to_counter(tx, "lease_counter", 100)  # rolled back with its savepoint
        raise Refused(RefusalCode.CURSOR_AHEAD, "no")

    group = store._group
    assert group is not None
    before = group.batches
    writes = [lambda tx: add_to_counter(tx, "lease_counter", 1) for _ in range(5)]
    outcomes = _behind_a_held_write(store, writes[:2] + [refuse] + writes[2:])
    assert outcomes[:2] == [1, 2] and outcomes[3:] == [3, 4, 5]  # in queue order, each seeing the earlier ones
    assert isinstance(outcomes[2], Refused)
    assert store.read(lambda tx: counter(tx, "lease_counter")) == 5
    assert group.batches - before == 2  # the held write alone, then the six queued behind it together


def test_a_failed_commit_fails_every_write_of_its_batch(store: Store) -> None:
    def dangling_lease(tx: Tx) -> str:
        # Checked at COMMIT, not at the statement: the whole batch's commit fails.
        tx.exec_driver_sql("PRAGMA defer_foreign_keys = ON")
        tx.execute(leases.insert().values(id="l1", node_id="no such node", policy_version=0, issued_at=0.0,
                                          expires_at=1.0, sampling={}))
        return "inserted"

    outcomes = _behind_a_held_write(store, [lambda tx: add_to_counter(tx, "lease_counter", 7), dangling_lease])
    assert all(isinstance(o, IntegrityError) for o in outcomes), outcomes
    assert store.read(lambda tx: counter(tx, "lease_counter")) == 0  # the first write's change was not stored
    assert store.read(lambda tx: tx.execute(select(func.count()).select_from(leases)).scalar_one()) == 0
    assert store.write(lambda tx: add_to_counter(tx, "lease_counter", 1)) == 1  # and the store goes on


def test_under_load_commits_are_paced_and_gather_what_queues_meanwhile(tmp_path: Path) -> None:
    """With `min_interval_s`, a write queued right after a commit waits for the rest of the interval (here: until
    the test has queued four more, as the interval's sleep) and those share its commit; an idle store commits at
    once. The sleep is the test's, so nothing depends on how fast the machine is."""
    asked: list[float] = []
    go_on = threading.Event()

    def sleep(seconds: float) -> None:
        asked.append(seconds)
        go_on.wait(60)

    s = Store(f"sqlite:///{tmp_path / 'c.sqlite'}")
    group = GroupCommit(s.engine, 64, min_interval_s=30.0, sleep=sleep)
    try:
        assert group.run(lambda tx: add_to_counter(tx, "lease_counter", 1)) == 1  # idle: no wait
        assert asked == []
        results: list[int] = []
        lock = threading.Lock()

        def write() -> None:
            value = group.run(lambda tx: add_to_counter(tx, "lease_counter", 1))
            with lock:
                results.append(value)

        first = threading.Thread(target=write)
        first.start()
        wait_for(lambda: asked, "the committer to wait out the interval")
        assert 0 < asked[0] <= 30.0
        others = [threading.Thread(target=write) for _ in range(4)]
        for t in others:
            t.start()
        wait_for(lambda: group.queued == 5, "five writes queued")
        go_on.set()
        for t in [first, *others]:
            t.join(60)
        assert sorted(results) == [2, 3, 4, 5, 6]
        assert (group.batches, group.writes) == (2, 6)  # the idle write alone, then the five together
    finally:
        go_on.set()
        group.close()
        s.close()


def test_without_a_committer_thread_its_owner_commits_when_due(tmp_path: Path) -> None:
    """`threaded=False` (the writer process): nothing commits until the owner calls `commit_due`; `due_in` says
    when: at once for an idle store, after the rest of the interval right after a commit, at once again once a batch
    is full; `close` commits what is still queued."""
    s = Store(f"sqlite:///{tmp_path / 'c.sqlite'}")
    group = GroupCommit(s.engine, 3, min_interval_s=3600.0, threaded=False)
    outcomes: list[tuple[BaseException | None, object]] = []

    def add() -> None:
        group.submit(lambda tx: add_to_counter(tx, "lease_counter", 1), True, lambda e, r: outcomes.append((e, r)))

    try:
        assert not group.threaded and group.due_in() is None  # nothing queued
        add()
        assert group.due_in() == 0.0 and outcomes == []  # idle: due now, and only the owner commits it
        group.commit_due()
        assert outcomes == [(None, 1)] and group.due_in() is None
        add()
        due = group.due_in()
        assert due is not None and 3500 < due <= 3600  # right after a commit: the rest of the interval
        add()
        add()
        assert group.due_in() == 0.0  # a full batch is due at once
        group.commit_due()
        assert outcomes[1:] == [(None, 2), (None, 3), (None, 4)] and (group.batches, group.writes) == (2, 4)
        add()
        assert group.due_in() > 0
    finally:
        group.close()  # commits the queued write
        s.close()
    assert outcomes[-1] == (None, 5) and group.writes == 5


def test_many_threads_lose_nothing(store: Store) -> None:
    def bump(tx: Tx) -> int:
        return add_to_counter(tx, "accepted_seq", 1)

    got: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(25):
            value = store.write(bump)
            with lock:
                got.append(value)

    threads = [threading.Thread(target=worker) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(1, 301))  # every write applied once, each answered with its own value
    assert store.read(lambda tx: tx.execute(select(kv.c.value).where(kv.c.key == "accepted_seq")).scalar_one()) == 300


def _nice(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_request_threads_run_below_the_committer(tmp_path: Path) -> None:
    """A server process opens its store, then lowers the thread that serves requests (and the ones it starts): the
    committer, started with the store, keeps the priority it had. Done in a thread of its own, since it changes
    the calling thread for good."""
    seen: dict[str, int] = {}

    def server() -> None:
        store = Store(f"sqlite:///{tmp_path / 'c.sqlite'}")
        try:
            seen["before"] = _nice(threading.get_native_id())
            lower_request_priority(store, 3)
            seen["server"] = _nice(threading.get_native_id())
            child = threading.Thread(target=lambda: seen.__setitem__("request", _nice(threading.get_native_id())))
            child.start()
            child.join()
            committer = store._group._thread.native_id  # type: ignore[union-attr]
            assert committer is not None
            seen["committer"] = _nice(committer)
        finally:
            store.close()

    t = threading.Thread(target=server)
    t.start()
    t.join(timeout=60)
    assert seen["server"] == seen["request"] == min(seen["before"] + 3, 19)
    assert seen["committer"] == seen["before"] < seen["server"]


def _fifo_permitted() -> bool:
    """Whether this process may put a thread under real-time FIFO scheduling (asked from a throwaway thread)."""
    allowed: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(os.sched_get_priority_min(os.SCHED_FIFO)))
        except OSError:
            allowed.append(False)
        else:
            allowed.append(True)

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return allowed[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scheduling policies are Linux's")
def test_the_committer_runs_real_time_where_the_process_may(tmp_path: Path) -> None:
    """Asked to, the committer runs under SCHED_FIFO when the process may (and says so), at normal priority when
    it may not; not asked, it always runs at normal priority. Writes go through either way."""
    permitted = _fifo_permitted()
    for asked in (True, False):
        store = Store(f"sqlite:///{tmp_path / f'{asked}.sqlite'}", realtime_committer=asked)
        try:
            group = store._group
            assert group is not None and group._thread.native_id is not None
            policy = os.sched_getscheduler(group._thread.native_id)
            assert group.realtime == (asked and permitted)
            assert policy == (os.SCHED_FIFO if asked and permitted else os.SCHED_OTHER)
            assert store.write(lambda tx: add_to_counter(tx, "accepted_seq")) == 1
        finally:
            store.close()
    assert not make_realtime(2**22 + 1)  # refused (no such thread: beyond any pid): False, nothing raised
