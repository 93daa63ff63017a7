"""A fair buffer, against a real coordinator (uvicorn on loopback, real Ed25519, SQLite and PostgreSQL): no identity
holds more than `max_identity_share` of the buffer, an allowance grows no faster than time, an abandoned lease costs
allowance in proportion to its size, a source's abandoned share bounds its fresh identities, and newcomers from a
new address get their part of the unproven share at once while other sources' identities fill it.

Time-dependent rules use the coordinator's injected clock; each test stays inside the signatures' clock window."""

from __future__ import annotations

import time

import pytest

from swarmrl.protocol import messages as m
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from tests.support.coordinator import Clock, Run, hoard, submission

pytestmark = pytest.mark.both_stores

NEW = 8  # admission.new_identity_prompts, the default


class FrozenClock(Clock):
    """The coordinator's clock moves only when the test advances it: an identity's age is the same on a busy
    machine (run with a clock_skew_s that accepts the nodes' real-time signatures)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = time.time()

    def __call__(self) -> float:
        return self.base + self.offset


def _accept_and_train(run: Run) -> None:
    """The verifier accepts (checked) everything pending; the trainer takes and acknowledges the feed."""
    pending = run.op.pending(1000)
    if pending:
        run.op.verdicts([m.Verdict(group_id=g.group_id, accepted=True, rewards=[0.0] * len(g.group.rollouts))
                         for g in pending])
    batch = run.op.training_batch(after_id=0, limit=4096)
    if batch.groups:
        run.op.ack(batch.groups[-1].group_id)


def _earn(run: Run, node: CoordinatorClient, groups: int) -> None:
    """`groups` accepted groups for `node`, NEW at a time."""
    for _ in range(groups // NEW):
        node.submit(submission(node.lease(NEW, 0)))
        _accept_and_train(run)


def _size(node: CoordinatorClient, max_prompts: int = m.MAX_PROMPTS_PER_LEASE) -> int:
    lease = node.lease(max_prompts, 0)
    assert lease is not None
    return len(lease.prompts)


def test_no_identity_holds_more_than_its_share_of_the_buffer(run_factory) -> None:
    """A proven identity whose allowance grew past a quarter of the buffer holds a quarter, and is refused more."""
    run = run_factory(max_buffered_groups=40, max_staleness=1)  # a quarter: 10 prompts (a new identity's 8 at least)
    run.publish(0)
    node = run.node("proven")
    _earn(run, node, 2 * NEW)
    run.clock.advance(100.0)  # its allowance: 8 + 16 groups, no faster than 0.1 per second: 18
    assert _size(node) == 10
    with pytest.raises(CoordinatorError) as e:
        node.lease(1, 0)
    assert e.value.status == 429 and "may hold 10 prompts" in e.value.reason


def test_allowance_grows_no_faster_than_time(run_factory) -> None:
    """Verified work earns allowance at most allowance_growth_per_s per second of the identity's age: a burst of
    fast work earns nothing at once."""
    run = run_factory(max_buffered_groups=1000, max_staleness=1, lease_ttl_s=120.0, clock=FrozenClock(),
                      clock_skew_s=1e6)
    run.publish(0)
    node = run.node()
    _earn(run, node, 2 * NEW)
    assert _size(node) == NEW  # 16 accepted groups in a second: still a new identity's 8
    run.clock.advance(60.0)
    # 60 s old: 8 + 6 (0.1 per second), of which 8 are held.
    got = node.lease(m.MAX_PROMPTS_PER_LEASE, 0)
    assert got is not None and len(got.prompts) == 6


def test_an_abandoned_lease_costs_allowance_in_proportion_to_its_size(run_factory) -> None:
    """Two fresh identities on machines of their own let a lease expire, one of 8 prompts and one of 2: the one
    that held more lost more (allowance 8 - abandoned, times the reliability squared)."""
    run = run_factory(lease_ttl_s=30.0, max_buffered_groups=1000)
    run.publish(0)
    big, small = run.node("big", source="127.0.0.2"), run.node("small", source="127.0.0.3")
    assert _size(big, NEW) == NEW and _size(small, 2) == 2
    run.clock.advance(31.0)
    assert _size(big) == 1  # (8 - 8) * (1 - 8 / 16)^2: 0, and never less than 1
    assert _size(small) == 3  # (8 - 2) * (1 - 2 / 10)^2 = 3.84


def test_a_sources_abandoned_share_bounds_its_fresh_identities(run_factory) -> None:
    """A fresh identity from a machine whose identities abandoned their leases starts below a new identity's
    allowance; one from another machine does not."""
    run = run_factory(lease_ttl_s=30.0, max_buffered_groups=1000)
    run.publish(0)
    hoarder = run.node("hoarder", source="127.0.0.2")
    assert sum(len(lease.prompts) for lease in hoard(hoarder)) == NEW
    run.clock.advance(31.0)
    run.node("swept", source="127.0.0.4").lease(1, 0)  # any lease request sweeps the expired lease
    fresh_there = run.node("fresh", source="127.0.0.2")
    assert _size(fresh_there) == 3  # 8 * (1 - 8 / (8 + 16))^2 = 3.6
    assert _size(run.node("elsewhere", source="127.0.0.3")) == NEW


def test_newcomers_from_a_new_address_get_their_part_while_others_fill_the_share(run_factory) -> None:
    """Fresh identities from four addresses hold the unproven share and keep asking; a newcomer from a fifth
    address gets an equal part at once, and again after it submits, while theirs wait: the freed part goes to it,
    not to whoever polls fastest."""
    run = run_factory(max_buffered_groups=32, max_staleness=1)  # the unproven share: 16 prompts
    run.publish(0)
    sybils = [run.node(f"sybil{i}.{j}", source=f"127.0.0.{10 + i}") for i in range(4) for j in range(2)]
    held = [sum(len(lease.prompts) for lease in hoard(s)) for s in sybils]
    assert sum(held) >= 16
    honest = run.node("honest", source="127.0.0.20")
    for _ in range(3):
        lease = honest.lease(NEW, 0)
        assert lease is not None and len(lease.prompts) == 16 // 5  # an equal part among five sources
        assert [hoard(s) for s in sybils] == [[]] * len(sybils)  # every sybil source holds its part
        honest.submit(submission(lease))
        _accept_and_train(run)


def test_new_sources_never_take_the_unproven_prompts_past_their_bound(run_factory) -> None:
    """A new source is served below its part even while the share is full, but never past max_unproven_prompts in
    all: free identities from many addresses cannot make the lease tables grow without bound."""
    run = run_factory(admission={"max_unproven_prompts": 10})  # no backpressure: the share is the bound, 10
    run.publish(0)
    assert _size(run.node("a", source="127.0.0.2"), NEW) == NEW  # the only source: its part is all 10
    assert _size(run.node("b", source="127.0.0.3"), NEW) == 2  # its part is 5, but only 2 are left in all
    assert run.node("c", source="127.0.0.4").lease(NEW, 0) is None


def test_a_long_record_pays_off_a_lost_lease_below_the_cap(run_factory) -> None:
    """What an abandoned lease costs is taken from what was earned before max_identity_prompts caps it: a node that
    earned past the cap loses less of it than the lease's size, where a fresh one loses all."""
    run = run_factory(lease_ttl_s=30.0, admission={"max_identity_prompts": 16}, clock=FrozenClock(),
                      clock_skew_s=1e6)
    run.publish(0)
    node = run.node()
    _earn(run, node, 3 * NEW)
    run.clock.advance(170.0)  # earned: 8 + min(24 groups, 17 by its age) = 25, capped at 16
    assert _size(node, NEW) == NEW
    run.clock.advance(31.0)  # expired: 8 abandoned of 32 leased
    # min(16, 8 + 20 - 8) * (1 - 8 / (32 + 8))^2 = 10.24 (deducted after the cap it would be 5)
    assert _size(node) == 10
