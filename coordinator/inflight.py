"""Prompts in flight, counted as leases open and close, so that a lease request reads a few rows, not every lease.

What backpressure and the unproven share are judged on (`coordinator.admission`) is the number of prompts in
flight: leased, in a lease still open, not submitted. It is kept as counters, moved in the transaction of every
change that moves it:

- a lease granted adds its prompts (`leasequeries.insert_lease` records what it counts as, `add_to` and `apply` move the
  counter rows, with `count_node` the node's own `in_flight`);
- a lease closed takes them back (`admission.settle_leases`): a submission settling it (the prompts it delivered
  and those it left out alike), a stale submission, the expiry sweep, the node's own next lease request after the
  lease expired, or the liveness sweep marking its node gone. A lease is closed exactly once (a conditional update
  of its state), so it is taken back exactly once.

Within an open lease no prompt is submitted in any committed state (a submission marks its prompts and settles the
lease in one transaction), so "the prompts of open leases" and "the prompts of open leases not submitted" are one
number.

The counters: `nodes.in_flight` (the node's own, any version), and rows of the `in_flight` table keyed by
(class, source, policy version, stripe): class `proven` and `unproven` per policy version (source ''), class
`source` per source the unproven identities registered from (any version, one row: policy version 0, stripe 0),
and class `sources`, the number of `source` rows (sources holding unproven prompts, which `admission.source_share`
divides the unproven share by), moved when a `source` row is created or reaches zero. The stripe of a `proven` or
`unproven` row is a hash of the node id, and of a `sources` row a hash of the source, so that concurrent
PostgreSQL writers rarely wait on one row; a read sums the few rows of the live policy versions, its source's row
and the `sources` rows: a fixed number of rows, however many nodes and sources the pool has (counting the sources
at each request read a row per source, and sorted them). A source's row is not striped: the leases of one
source's unproven identities take turns at it, a commit each; a source holds at most `unproven_per_source` unproven
prompts in flight (`admission.source_share`), so few of its leases open or close at once. A lease records what it
was counted as (`leases.flight_class`, `flight_source`, `flight_stripe`, `flight_n`), and its closing takes back
exactly that.

How this differs from counting the open leases at each request (what the coordinator did before):
- a lease counts in the class and source its node had when it was granted: a node that becomes proven (or
  registers again from another address) while holding a lease has that lease counted as before until it closes
  (lease_ttl_s at most, and the sweep after it). Its prompts are counted all the same, in the unproven share
  (or the old source's) instead of the proven one: for one lease's life the proven figure reads a little lower
  and the unproven one higher than a recount would;
- an expired lease counts until it is settled: by its node's next lease request (so a node's own figure is exact
  when it asks), or by the expiry sweep for everyone else's figures (`Leases._sweep` in `coordinator.leases`:
  once a second, and on every lease request while it finds a full batch). This only ever counts more in flight,
  never less: a lease may wait for room a little longer, nobody gets more than the rules allow;
- the leases of a banned node count until they expire and are swept, as they did before.
Rows at zero are deleted as they reach it, so the table holds only what is in flight.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from sqlalchemy import BigInteger, Integer, and_, bindparam, case, delete, exists, func, or_, select, update

from swarmrl.coordinator.db.fast import Prepared
from swarmrl.coordinator.db.rows import NodeRow
from swarmrl.coordinator.db.schema import in_flight as table
from swarmrl.coordinator.db.schema import nodes, prompt_queue
from swarmrl.coordinator.db.store import Tx, insert

STRIPES = 16
PROVEN, UNPROVEN, SOURCE, SOURCES = "proven", "unproven", "source", "sources"

Key = tuple[str, str, int, int]
"""A counter row: (class, source, policy version, stripe)."""


@dataclass(frozen=True)
class InFlight:
    """Prompts leased and not submitted, in open leases."""

    own: int
    """The requesting identity's (any version)."""
    proven: int
    """Proven identities' (the requester's included), of a usable policy version."""
    unproven: int
    """Unproven identities' (the requester's included), any version."""
    unproven_usable: int
    """Unproven identities', of a usable policy version."""
    unproven_same_source: int
    """Unproven identities' registered from the requester's source (any version)."""
    queued: bool = field(default=True, compare=False)
    """Whether a prompt waits in the queue that the requester did not abandon (read with the counters, in the same
    statement, so that a grant reads the queue only when one does: `admission.take_queued`). Not a count."""
    source_record: tuple[int, int] = field(default=(0, 0), compare=False)
    """(prompts leased, prompts abandoned) by every identity of the requester's source (`admission.allowance`),
    read in the same statement."""
    other_sources: int = field(default=0, compare=False)
    """Sources other than the requester's whose unproven identities hold prompts in flight (`other_sources`), read in
    the same statement."""


def stripe(key: str) -> int:
    """The stripe of a node's (by its id) or a source's counter rows."""
    return zlib.crc32(key.encode()) % STRIPES


def counted_as(proven: bool, source: str) -> tuple[str, str]:
    """The (class, source) a lease of a node that is (not) `proven`, registered from `source`, is counted as."""
    return (PROVEN, "") if proven else (UNPROVEN, source)


def keys(cls: str, source: str, version: int, stripe_: int) -> list[Key]:
    """The counter rows a lease counted as (`cls`, `source`) of `version` moves; none for a lease counted nowhere
    (class '': closed before counting began)."""
    if cls == PROVEN:
        return [(PROVEN, "", version, stripe_)]
    if cls == UNPROVEN:
        return [(UNPROVEN, "", version, stripe_), (SOURCE, source, 0, 0)]
    return []


def add_to(deltas: dict[Key, int], cls: str, source: str, version: int, stripe_: int, n: int) -> None:
    for key in keys(cls, source, version, stripe_):
        deltas[key] = deltas.get(key, 0) + n


_c = table.c
_KEY = and_(_c.cls == bindparam("b_cls"), _c.source == bindparam("b_source"),
            _c.policy_version == bindparam("b_version", type_=BigInteger), _c.stripe == bindparam("b_stripe",
                                                                                                type_=Integer))
_SUB = Prepared(update(table).where(_KEY).values(n=_c.n - bindparam("b_n", type_=BigInteger)))
_DROP = Prepared(delete(table).where(_KEY, _c.n == 0))


def _inserts(dialect: str) -> tuple[Prepared, Prepared]:
    """The row inserted, or added to where it exists (`_ADD`); and inserted only where it does not (`_CREATE`)."""
    stmt = insert(dialect, table).values(cls=bindparam("b_cls"), source=bindparam("b_source"),
                                         policy_version=bindparam("b_version", type_=BigInteger),
                                         stripe=bindparam("b_stripe", type_=Integer),
                                         n=bindparam("b_n", type_=BigInteger))
    return (Prepared(stmt.on_conflict_do_update(index_elements=[_c.cls, _c.source, _c.policy_version, _c.stripe],
                                                set_={"n": _c.n + stmt.excluded.n})),
            Prepared(stmt.on_conflict_do_nothing()))


_SQLITE_INSERTS, _PG_INSERTS = _inserts("sqlite"), _inserts("postgresql")
_ADD = {"sqlite": _SQLITE_INSERTS[0], "postgresql": _PG_INSERTS[0]}
_CREATE = {"sqlite": _SQLITE_INSERTS[1], "postgresql": _PG_INSERTS[1]}
_INC = Prepared(update(table).where(_KEY).values(n=_c.n + bindparam("b_n", type_=BigInteger)))


def apply(tx: Tx, deltas: dict[Key, int]) -> None:
    """Move the counter rows by `deltas`, and the `sources` rows by the `source` rows created and emptied, in key
    order (`source` < `sources` < `unproven`), so that two transactions never wait on each other's rows in opposite
    orders; a row that reaches zero is deleted."""
    sources: dict[Key, int] = {}
    for key in sorted(deltas):
        if key[0] > SOURCES and sources:
            apply(tx, sources)
            sources = {}
        change = _move(tx, key, deltas[key])
        if change and key[0] == SOURCE:
            counter = (SOURCES, "", 0, stripe(key[1]))
            sources[counter] = sources.get(counter, 0) + change
    if sources:
        apply(tx, sources)


def _move(tx: Tx, key: Key, n: int) -> int:
    """Move row `key` by `n`: 1 when that created a `source` row, -1 when it emptied (deleted) a row, else 0."""
    params = dict(b_cls=key[0], b_source=key[1], b_version=key[2], b_stripe=key[3])
    if n < 0:
        _SUB.rowcount(tx, b_n=-n, **params)
        return -_DROP.rowcount(tx, **params)
    if n == 0:
        return 0
    if key[0] != SOURCE:
        _ADD[tx.dialect.name].rowcount(tx, b_n=n, **params)
        return 0
    while True:
        # Added to, or else created. On PostgreSQL a concurrent transaction may create or delete the row between
        # the two statements (the insert then waits for it): round again.
        if _INC.rowcount(tx, b_n=n, **params) == 1:
            return 0
        if _CREATE[tx.dialect.name].rowcount(tx, b_n=n, **params) == 1:
            return 1


_min = bindparam("b_min", type_=BigInteger)
_src = bindparam("b_src")
_SUMS = Prepared(select(
    func.coalesce(func.sum(case((and_(_c.cls == PROVEN, _c.policy_version >= _min), _c.n), else_=0)), 0),
    func.coalesce(func.sum(case((_c.cls == UNPROVEN, _c.n), else_=0)), 0),
    func.coalesce(func.sum(case((and_(_c.cls == UNPROVEN, _c.policy_version >= _min), _c.n), else_=0)), 0),
    func.coalesce(func.sum(case((_c.cls == SOURCE, _c.n), else_=0)), 0),
    func.coalesce(func.sum(case((_c.cls == SOURCES, _c.n), else_=0)), 0),
    exists().where(prompt_queue.c.abandoned_by != bindparam("b_node")),
    # What else a grant reads, in the same round trip: the source's record.
    select(func.coalesce(func.sum(nodes.c.prompts_leased), 0)).where(nodes.c.source == _src).scalar_subquery(),
    select(func.coalesce(func.sum(nodes.c.prompts_abandoned), 0)).where(nodes.c.source == _src).scalar_subquery(),
).where(or_(_c.cls == PROVEN, _c.cls == UNPROVEN, _c.cls == SOURCES, and_(_c.cls == SOURCE, _c.source == _src))))


def read(tx: Tx, node: NodeRow, min_version: int, pending: dict[Key, int] | None = None) -> InFlight:
    """What is in flight, as seen by `node` (its row as read in this transaction) asking for a lease; usable: of
    policy version >= `min_version`. `pending`: counter moves of this transaction not yet applied, counted too."""
    proven, unproven, usable, same, sources, queued, leased, abandoned = _SUMS.first(
        tx, b_min=min_version, b_src=node.source, b_node=node.id)
    others = sources - (1 if same > 0 else 0)
    for (cls, source, version, _), n in (pending or {}).items():
        if cls == PROVEN:
            proven += n if version >= min_version else 0
        elif cls == UNPROVEN:
            unproven += n
            usable += n if version >= min_version else 0
        elif cls == SOURCE and source == node.source:
            same += n
    return InFlight(node.in_flight, int(proven), int(unproven), int(usable), int(same), bool(queued),
                    (int(leased), int(abandoned)), int(others))

