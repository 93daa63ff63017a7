"""The in-flight counters (`coordinator.inflight`) against a recount: random sequences of registrations (from three
sources, and again from another), leases, submissions (whole, partial, stale), expiries (the clock advanced, the
sweep run by the next lease request), verdicts (acceptances that make nodes proven, bans), new policy versions and
nodes marked gone, all through a real coordinator's HTTP API (SQLite and PostgreSQL); after each step the figures
a lease request reads equal a recount over every open lease, for every node.

The recount is the query the coordinator ran per lease request before the counters (lease_prompts x leases x
nodes), kept here as the oracle, with the counters' rule for a lease's class and source: those its node had when
the lease was granted, which this test notes itself at each grant (from /v1/status, not from the counters'
columns)."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from swarmrl.coordinator import admission, registry
from swarmrl.coordinator.checkpoints import current_version
from swarmrl.coordinator.db.schema import in_flight, lease_prompts, leases, nodes
from swarmrl.coordinator.db.store import Store, Tx
from swarmrl.coordinator.inflight import InFlight
from swarmrl.coordinator.liveness import Housekeeping
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from tests.support.coordinator import Clock, Run, submission

pytestmark = pytest.mark.both_stores  # each test on SQLite and on PostgreSQL (conftest.py)

PROVEN_AFTER = 2
STALENESS = 1
TTL = 30.0
GONE_AFTER = 100.0
SEEDS = [int(s) for s in os.environ.get("SWARMRL_INFLIGHT_SEEDS", "1,2,3").split(",")]

_p, _l, _n = lease_prompts.c, leases.c, nodes.c
# The pre-counter recount, less its expiry filter (an expired lease counts until it is settled) and with the
# lease's id, so that each lease can be classed as it was when granted.
_OPEN_PROMPTS = (select(_l.id, _l.node_id, _l.policy_version, _n.groups_accepted, _n.source, func.count().label("n"))
                 .select_from(lease_prompts.join(leases, _l.id == _p.lease_id).join(nodes, _n.id == _l.node_id))
                 .where(_p.submitted.is_(False), _l.state == "open")
                 .group_by(_l.id, _l.node_id, _l.policy_version, _n.groups_accepted, _n.source))


class FrozenClock(Clock):
    """A clock that moves only when the test advances it: which leases expire is the same on a busy machine."""

    def __init__(self) -> None:
        super().__init__()
        self.base = time.time()

    def __call__(self) -> float:
        return self.base + self.offset


@dataclass(frozen=True)
class Granted:
    node_id: str
    proven: bool
    source: str


def oracle(tx: Tx, granted: dict[str, Granted], me: str, source: str, min_version: int,
           changed: set[str] | None = None) -> InFlight:
    """The figures `me` (registered from `source`) sees, recounted; the open leases whose node changed class or
    source since the grant (where the pre-counter rule would class them otherwise) are added to `changed`."""
    own = proven = unproven = usable = same = 0
    sources: set[str] = set()
    for lease_id, node_id, version, accepted, node_source, n in tx.execute(_OPEN_PROMPTS):
        g = granted[lease_id]
        assert g.node_id == node_id
        if changed is not None and (g.proven != (accepted >= PROVEN_AFTER) or g.source != node_source):
            changed.add(lease_id)
        own += n if node_id == me else 0
        if g.proven:
            proven += n if version >= min_version else 0
        else:
            unproven += n
            usable += n if version >= min_version else 0
            same += n if g.source == source else 0
            sources.add(g.source)
    return InFlight(own, proven, unproven, usable, same, other_sources=len(sources - {source}))


class Swarm:
    """The test's nodes and what it knows of them."""

    def __init__(self, run: Run, rng: random.Random, tag: str):
        self.run, self.rng, self.tag = run, rng, tag
        self.store = Store(run.cfg.resolved_store_url)
        self.version = 0
        self.clients: dict[str, CoordinatorClient] = {}
        self.source: dict[str, str] = {}
        self.banned: set[str] = set()
        self.leases: dict[str, m.Lease] = {}
        self.granted: dict[str, Granted] = {}
        self.kinds: set[str] = set()  # the kinds of steps taken
        self.refused: set[int] = set()  # the statuses of refused submissions
        self.changed: set[str] = set()  # leases seen open after their node changed class or source
        self.next_leases = 0  # leases granted with a submission
        self.most_other_sources = 0  # the most other sources holding unproven prompts any node saw

    def client(self, identity, address: str) -> CoordinatorClient:
        return CoordinatorClient(self.run.url, identity, retries=0, coordinator_key=self.run.key.public_key_hex,
                                 transport=httpx.HTTPTransport(local_address=address))

    def register(self, node: CoordinatorClient | None = None) -> None:
        address = self.rng.choice(["127.0.0.1", "127.0.0.2", "127.0.0.3"])
        identity = node.identity if node is not None else Identity.generate()
        client = self.client(identity, address)
        client.register(name="n", engine="torch")
        self.clients[identity.node_id] = client
        self.source[identity.node_id] = address

    def accepted(self) -> dict[str, int]:
        return {n.node_id: n.groups_accepted for n in self.run.op.status(nodes=1000).nodes}

    def lease(self, node_id: str) -> None:
        proven = self.accepted()[node_id] >= PROVEN_AFTER
        try:
            lease = self.clients[node_id].lease(self.rng.randint(1, 8), self.version)
        except CoordinatorError as e:
            assert e.status in (403, 429), e.reason
            return
        if lease is not None:
            self.leases[lease.lease_id] = lease
            self.granted[lease.lease_id] = Granted(node_id, proven, self.source[node_id])

    def submit(self, lease: m.Lease) -> None:
        """Half the submissions ask for the next lease: settling one lease and granting the next move the same
        counter rows in one transaction."""
        prompts = [p for p in lease.prompts if self.rng.random() < 0.7] or lease.prompts[:1]
        sub = submission(lease, prompts=prompts)
        node_id = lease.node_id
        if self.rng.random() < 0.5:
            sub.next_lease = m.LeaseRequest(max_prompts=self.rng.randint(1, 8), held_version=self.version)
            proven = self.accepted()[node_id] >= PROVEN_AFTER
        try:
            result = self.clients[node_id].submit(sub)
        except CoordinatorError as e:
            assert e.status in (403, 409, 410), e.reason
            self.refused.add(e.status)
            return
        if result.next_lease is not None:
            self.next_leases += 1
            self.leases[result.next_lease.lease_id] = result.next_lease
            self.granted[result.next_lease.lease_id] = Granted(node_id, proven, self.source[node_id])

    def verify(self) -> None:
        pending = self.run.op.pending(1000)
        verdicts = []
        cheat = self.rng.choice([g.node_id for g in pending]) if pending and self.rng.random() < 0.5 else None
        for g in pending:
            ban = g.node_id == cheat and cheat not in self.banned
            if ban:
                self.banned.add(g.node_id)
            verdicts.append(m.Verdict(group_id=g.group_id, accepted=not ban, ban=ban, reason="x" if ban else "",
                                      rewards=[] if ban else [0.0] * len(g.group.rollouts)))
        if verdicts:
            self.run.op.verdicts(verdicts)
        batch = self.run.op.training_batch(after_id=0, limit=4096)
        if batch.groups:
            self.run.op.ack(batch.groups[-1].group_id)

    def gone(self) -> None:
        """All nodes but a random half fall silent past node_gone_after_s; the liveness sweep frees their leases."""
        self.run.clock.advance(GONE_AFTER + 1)
        for node_id, client in self.clients.items():
            if node_id not in self.banned and self.rng.random() < 0.5:
                client.heartbeat(self.version)
        Housekeeping(self.store, self.run.cfg, self.run.clock).sweep()

    def step(self) -> str:
        self.run.clock.advance(0.25)  # time moves (a challenge is single use per key and moment) but by the test
        live = [n for n in self.clients if n not in self.banned]
        kind = self.rng.choices(["register", "lease", "submit", "expire", "verify", "publish", "gone", "again"],
                                [2, 10, 6, 2, 3, 2, 1, 2])[0]
        if kind == "register" or not live:
            self.register()
        elif kind == "lease":
            self.lease(self.rng.choice(live))
        elif kind == "submit" and self.leases:
            lease_id = self.rng.choice(list(self.leases))
            self.submit(self.leases[lease_id] if self.rng.random() < 0.1 else self.leases.pop(lease_id))
        elif kind == "expire":
            self.run.clock.advance(TTL + 1)
            self.lease(self.rng.choice(live))  # its request runs the expiry sweep
        elif kind == "verify":
            self.verify()
        elif kind == "publish":  # one or two versions: the open leases of the one before turn stale
            for _ in range(self.rng.randint(1, 2)):
                self.version += 1
                self.run.publish(self.version, tag=self.tag)
        elif kind == "gone":
            self.gone()
        elif kind == "again":  # registered again (maybe from another source) while it holds a lease, likely
            holders = [g.node_id for i, g in self.granted.items() if i in self.leases and g.node_id in live]
            self.register(self.clients[self.rng.choice(holders or live)])
        return kind

    def check(self) -> None:
        def compare(tx: Tx) -> None:
            min_version = current_version(tx) - STALENESS
            per_node: dict[str, int] = {}
            for node_id in self.clients:
                row = registry.get_node(tx, node_id)
                got = admission.in_flight(tx, row, min_version)
                want = oracle(tx, self.granted, node_id, row.source, min_version, self.changed)
                assert got == want, (node_id, got, want)
                assert got.other_sources == want.other_sources, (node_id, got, want)
                self.most_other_sources = max(self.most_other_sources, got.other_sources)
                per_node[node_id] = want.own
            assert all(n > 0 for n in tx.execute(select(in_flight.c.n)).scalars())  # rows at zero are gone
            assert {r.id: r.in_flight for r in tx.execute(select(_n.id, _n.in_flight))} == per_node

        self.store.read(compare)


def _run_random(run_factory, data_dir: Path, seed: int, steps: int) -> Swarm:
    run = run_factory(data_dir=data_dir, clock=FrozenClock(), lease_ttl_s=TTL, node_gone_after_s=GONE_AFTER,
                      housekeeping_interval_s=3600.0, clock_skew_s=1e6, max_staleness=STALENESS,
                      max_buffered_groups=64, admission={"proven_after_groups": PROVEN_AFTER,
                                                         "unproven_per_source": 12})
    run.publish(0, tag=str(seed))
    swarm = Swarm(run, random.Random(seed), str(seed))
    try:
        for _ in range(3):
            swarm.register()
        for _ in range(steps):
            swarm.kinds.add(swarm.step())
            swarm.check()
    finally:
        swarm.store.close()
    return swarm


def test_the_counters_equal_a_recount_after_every_step(run_factory, tmp_path: Path) -> None:
    swarms = [_run_random(run_factory, tmp_path / f"coord-{seed}", seed, steps=160) for seed in SEEDS]
    # Together, the sequences did exercise everything that moves the counters.
    assert {"lease", "submit", "expire", "verify", "publish", "gone", "again"} <= set().union(
        *(s.kinds for s in swarms))
    assert 409 in set().union(*(s.refused for s in swarms))  # stale submissions
    assert all(s.next_leases for s in swarms)
    assert max(s.most_other_sources for s in swarms) == 2  # every other source was counted at some point
    assert any(s.banned for s in swarms) and any(s.changed for s in swarms)
    granted = [g for s in swarms for g in s.granted.values()]
    assert any(g.proven for g in granted) and any(not g.proven for g in granted)


def test_a_lease_counts_as_granted_until_it_closes(run_factory) -> None:
    """A node that becomes proven while holding a lease: the lease stays in the unproven count until its submission
    settles it, which takes it back from there (nothing is left behind, nothing goes negative)."""
    run = run_factory(max_staleness=STALENESS, admission={"proven_after_groups": 1})
    run.publish(0)
    node = run.node()
    first, second = node.lease(1, 0), node.lease(2, 0)
    node.submit(submission(first))
    run.op.verdicts([m.Verdict(group_id=g.group_id, accepted=True, rewards=[0.0] * len(g.group.rollouts))
                     for g in run.op.pending(10)])
    store = Store(run.cfg.resolved_store_url)
    try:
        def figures(tx: Tx) -> InFlight:
            return admission.in_flight(tx, registry.get_node(tx, node.identity.node_id), 0)

        assert store.read(figures) == InFlight(own=2, proven=0, unproven=2, unproven_usable=2, unproven_same_source=2)
        third = node.lease(3, 0)  # proven now: counted there
        assert store.read(figures) == InFlight(own=5, proven=3, unproven=2, unproven_usable=2, unproven_same_source=2)
        node.submit(submission(second, prompts=second.prompts[:1]))
        assert store.read(figures) == InFlight(own=3, proven=3, unproven=0, unproven_usable=0, unproven_same_source=0)
        node.submit(submission(third))
        assert store.read(figures) == InFlight(0, 0, 0, 0, 0)
        assert store.read(lambda tx: tx.execute(select(func.count()).select_from(in_flight)).scalar_one()) == 0
    finally:
        store.close()


def test_a_request_that_settles_its_own_expired_lease_and_gets_none_still_takes_it_back(run_factory) -> None:
    """A node's expired lease, not yet swept, is settled by its next lease request; when that request is then told
    to wait (backpressure), the settled lease still stops counting (in its own figure and everyone's)."""
    clock = FrozenClock()
    run = run_factory(clock=clock, clock_skew_s=1e6, lease_ttl_s=TTL, max_buffered_groups=4,
                      admission={"proven_after_groups": 0})
    run.publish(0)
    a, b = run.node("a"), run.node("b")
    assert len(a.lease(1, 0).prompts) == 1
    clock.advance(TTL - 0.5)
    assert len(b.lease(8, 0).prompts) == 8  # its request ran the sweep: nothing had expired yet
    clock.advance(0.7)  # a's lease has expired; the next sweep is not due for another 0.3 s
    assert a.lease(1, 0) is None  # b's 8 fill the buffer
    store = Store(run.cfg.resolved_store_url)
    try:
        row = store.read(lambda tx: registry.get_node(tx, a.identity.node_id))
        assert row.prompts_abandoned == 1
        assert store.read(lambda tx: admission.in_flight(tx, row, 0)) == InFlight(0, 8, 0, 0, 0)
    finally:
        store.close()
