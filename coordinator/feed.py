"""The trainer feed: accepted groups in the order they were accepted, read without side effects and
acknowledged explicitly.

Each accepted group gets a feed position (1, 2, 3, ...: `TrainingGroup.group_id`). Positions are gap-free and
become visible in order (`next_position`), so a trainer that has consumed everything up to its cursor c and asks
for positions after c never skips one. Reading the feed moves nothing. The trainer acknowledges a cursor once it
has durably saved the state that consumed everything up to it (POST /v1/trainer/ack); the acknowledged cursor
only moves forward. What the trainer has been handed is recorded apart (`FEED_READ`, the highest position handed
out): backpressure counts accepted groups after it, so a trainer that holds groups while it fills a batch never
holds the room that would let the rest of the batch be leased (docs/liveness.md). A trainer that restarts reads
again from its acknowledged cursor; those groups are simply not counted twice.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import select

from swarmrl.coordinator.auth import Refused, Signed
from swarmrl.coordinator.checkpoints import current_version
from swarmrl.coordinator.db.rows import FeedRow
from swarmrl.coordinator.db.schema import FEED_ACKED, FEED_HEAD, FEED_READ, TRAINER_SEEN_AT, nodes, rollout_groups
from swarmrl.coordinator.db.store import Store, Tx, add_to_counter, counter, load, raise_counter
from swarmrl.coordinator.gate import admit
from swarmrl.coordinator.idempotency import remember
from swarmrl.coordinator.longpoll import LongPolls
from swarmrl.protocol import messages as m
from swarmrl.protocol.refusals import RefusalCode


def next_position(tx: Tx) -> int:
    """The feed position of a group being accepted in this transaction (which must store it with the group).

    It comes from the FEED_HEAD counter row, incremented by an UPDATE that keeps the row locked until the
    transaction ends. Another accepting transaction, in this process or another one on the same PostgreSQL, waits
    for that lock and so takes the next position only after this transaction committed (or rolled back, handing
    its positions back): positions commit in increasing order with no holes, and whoever sees position p sees
    every position below it. A database sequence would not do: two transactions take 7 and 8, 8 commits first, a
    trainer reads 8 and moves its cursor past 7 before 7 is visible, and never trains on it. On SQLite writers are
    serialized anyway.
    """
    return add_to_counter(tx, FEED_HEAD, 1)


def head(tx: Tx) -> int:
    """The last position handed out (0 before the first)."""
    return counter(tx, FEED_HEAD)


def acked(tx: Tx) -> int:
    """The cursor the trainer last acknowledged (0 before the first acknowledgement)."""
    return counter(tx, FEED_ACKED)


def read_cursor(tx: Tx) -> int:
    """The highest feed position handed to the trainer (or acknowledged by it)."""
    return counter(tx, FEED_READ)


def trainer_seen(tx: Tx, now: float, handed: int = 0) -> None:
    """The trainer was heard from at `now` and has been handed the feed up to position `handed`."""
    raise_counter(tx, TRAINER_SEEN_AT, int(now))
    if handed:
        raise_counter(tx, FEED_READ, handed)


def entries_after(tx: Tx, after: int, limit: int) -> list[FeedRow]:
    """Up to `limit` accepted groups at positions after `after`, in position order."""
    g, n = rollout_groups.c, nodes.c
    rows = tx.execute(select(g.accepted_seq, g.policy_version, g.payload, g.rewards, g.lease_id,
                             n.public_key.label("node_key"))
                      .select_from(rollout_groups.join(nodes, n.id == g.node_id))
                      .where(g.accepted_seq > after).order_by(g.accepted_seq).limit(limit))
    return [load(FeedRow, r) for r in rows]


class Feed:
    """The trainer's side: read batches (long-polling when there is nothing new) and acknowledge."""

    def __init__(self, store: Store, long_polls: LongPolls, clock: Callable[[], float]):
        self.store, self.long_polls, self.clock = store, long_polls, clock

    def batch(self, req: Signed) -> m.TrainingBatch:
        """Accepted groups after `after_id`, in feed order; group_id is the feed position. With `wait_s`, waits up
        to that long for one when there is none yet. Changes nothing."""
        body: m.BatchRequest = req.payload

        def admitted(tx: Tx) -> None:
            admit(tx, req)
            trainer_seen(tx, self.clock())

        # The nonce and the watchdog's "trainer heard from"; reading changes nothing else the trainer relies on.
        self.store.write(admitted, durable=False)
        rows = self.long_polls.wait(lambda: self.store.read(lambda tx: entries_after(tx, body.after_id, body.limit)),
                                    body.wait_s)
        if rows:  # in the trainer's hands now: no longer held against the nodes' leases (lost with a crash: counted)
            self.store.write(lambda tx: trainer_seen(tx, self.clock(), rows[-1].accepted_seq), durable=False)
        groups = [m.TrainingGroup(group_id=r.accepted_seq, policy_version=r.policy_version,
                                  group=m.RolloutGroup.model_validate(r.payload), rewards=r.rewards,
                                  lease_id=r.lease_id, node_key=r.node_key) for r in rows]
        return m.TrainingBatch(current_version=self.store.read(current_version), groups=groups)

    def ack(self, req: Signed) -> m.FeedAcked:
        """Acknowledge every position up to `cursor`; an older acknowledgement than the last changes nothing."""
        cursor = req.payload.cursor
        now = self.clock()

        def acknowledge(tx: Tx) -> m.FeedAcked:
            admit(tx, req)
            top = head(tx)
            if cursor > top:
                raise Refused(RefusalCode.CURSOR_AHEAD,
                              f"cursor {cursor} is beyond the last feed position handed out ({top})")
            raise_counter(tx, FEED_ACKED, cursor)
            trainer_seen(tx, now, cursor)
            answer = m.FeedAcked(acked=acked(tx), head=top)
            remember(tx, req, answer, now)
            return answer

        return self.store.write(acknowledge)
