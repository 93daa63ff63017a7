"""Verification: the pending queue, verifiers' claims, verdicts, and the whole quarantine state machine.

A submitted group's life from here on (`rollout_groups.status`, `held`):

    pending --claim--> pending, claimed (claimed_until; an expired claim is claimable again)
    pending --verdict: accepted, checked------> accepted (a feed position), after RELEASE of its node
    pending --verdict: accepted, not checked--> HELD (pending, held; trusted rewards kept; not claimable)
    pending --verdict: rejected---------------> rejected; with `ban`: BAN of its node
    HELD    --RELEASE-------------------------> accepted (a feed position)
    HELD    --BAN---------------------------------> rejected ("node banned")

    RELEASE of node n at group g: n's held groups submitted before g are accepted, oldest first, before g itself
            (a full check that passes on a later group vouches for the node's earlier ones).
    BAN of node n: n is banned (for good); every pending group of n, held or not, is rejected.

The verifier's policy only says whether it ran the full check (`Verdict.checked`); when a held group is released
or dropped is decided here and nowhere else. Verdicts on groups already decided, held, or unknown are ignored, so
a retried or duplicated batch changes nothing. A batch is validated whole before any of it is applied.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sqlalchemy import func, select, update

from swarmrl.coordinator import feed, registry
from swarmrl.coordinator.auth import Refused, Signed
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.rows import ClaimedGroup, GroupRow
from swarmrl.coordinator.db.schema import FEED_HEAD, lease_prompts, leases, nodes, rollout_groups
from swarmrl.coordinator.db.store import Store, Tx, counter, load
from swarmrl.coordinator.longpoll import LongPolls
from swarmrl.protocol import messages as m

MAX_REASON_CHARS = 1000
g = rollout_groups.c

# -- queries ----------------------------------------------------------------------------------------------


def get_group(tx: Tx, group_id: int) -> GroupRow | None:
    row = tx.execute(select(rollout_groups).where(g.id == group_id)).first()
    return load(GroupRow, row) if row is not None else None


def lock_groups(tx: Tx, group_ids: list[int]) -> dict[int, GroupRow]:
    """The groups with these ids, locked until the transaction ends (in id order, so no two lockers deadlock)."""
    rows = tx.execute(select(rollout_groups).where(g.id.in_(sorted(set(group_ids)))).order_by(g.id).with_for_update())
    return {r.id: load(GroupRow, r) for r in rows}


def claim_pending(tx: Tx, claimer: str, limit: int, now: float, until: float) -> list[ClaimedGroup]:
    """Claim up to `limit` pending, unheld groups nobody holds a live claim on, oldest first, with their lease
    facts. Rows another transaction has locked (being claimed or decided) are skipped, not waited for."""
    ids = list(tx.execute(select(g.id).where(g.status == "pending", g.held.is_(False),
                                             (g.claimed_until.is_(None)) | (g.claimed_until < now))
                          .order_by(g.id).limit(limit).with_for_update(skip_locked=True)).scalars())
    if not ids:
        return []
    tx.execute(update(rollout_groups).where(g.id.in_(ids)).values(claimed_by=claimer, claimed_until=until))
    p, lc, n = lease_prompts.c, leases.c, nodes.c
    rows = tx.execute(
        select(g.id, g.node_id, g.policy_version, g.payload, p.text.label("prompt_text"), p.answer, p.seeds,
               lc.policy_version.label("lease_version"), lc.sampling, n.checks_passed.label("node_checks_passed"))
        .select_from(rollout_groups.join(lease_prompts, (p.lease_id == g.lease_id) & (p.prompt_id == g.prompt_id))
                     .join(leases, lc.id == g.lease_id).join(nodes, n.id == g.node_id))
        .where(g.id.in_(ids)).order_by(g.id))
    return [load(ClaimedGroup, r) for r in rows]


def accept(tx: Tx, group_id: int, rewards: list[float], now: float) -> int | None:
    """Accept a pending group at the next feed position, which is returned; None (and no position used) if the
    group is not pending."""
    row = tx.execute(select(g.id).where(g.id == group_id, g.status == "pending").with_for_update()).first()
    if row is None:
        return None
    seq = feed.next_position(tx)
    tx.execute(update(rollout_groups).where(g.id == group_id).values(
        status="accepted", rewards=rewards, accepted_seq=seq, decided_at=now, claimed_until=None, held=False))
    return seq


def hold(tx: Tx, group_id: int, rewards: list[float], now: float) -> bool:
    """Hold a pending, unheld group with its trusted rewards; False if it is not such a group."""
    return tx.execute(update(rollout_groups).where(g.id == group_id, g.status == "pending", g.held.is_(False))
                      .values(held=True, rewards=rewards, decided_at=now, claimed_until=None)).rowcount == 1


def release(tx: Tx, node_id: str, before_id: int, now: float) -> list[int]:
    """Accept, in submission order, the node's held groups submitted before group `before_id`; their ids."""
    held = tx.execute(select(g.id, g.rewards).where(g.node_id == node_id, g.status == "pending", g.held.is_(True),
                                                    g.id < before_id).order_by(g.id).with_for_update()).all()
    return [r.id for r in held if accept(tx, r.id, r.rewards, now) is not None]


def reject(tx: Tx, group_id: int, reason: str, now: float) -> bool:
    return tx.execute(update(rollout_groups).where(g.id == group_id, g.status == "pending").values(
        status="rejected", reason=reason, decided_at=now, claimed_until=None)).rowcount == 1


def reject_pending_of_node(tx: Tx, node_id: str, reason: str, now: float) -> int:
    """Reject every still-pending group of a node, held ones included; how many."""
    return tx.execute(update(rollout_groups).where(g.node_id == node_id, g.status == "pending").values(
        status="rejected", reason=reason, decided_at=now, claimed_until=None)).rowcount


def group_counts(tx: Tx) -> dict[str, int]:
    """Groups by status, and `held` (pending groups that are held)."""
    counts = {"pending": 0, "accepted": 0, "rejected": 0}
    for status, n in tx.execute(select(g.status, func.count()).group_by(g.status)):
        counts[status] = int(n)
    counts["held"] = int(tx.execute(select(func.count()).select_from(rollout_groups)
                                    .where(g.status == "pending", g.held.is_(True))).scalar_one())
    return counts


# -- rules ------------------------------------------------------------------------------------------------


class Verification:
    """The verifiers' side: claiming pending groups (long-polling when there are none) and posting verdicts."""

    def __init__(self, store: Store, config: CoordinatorConfig, clock: Callable[[], float], long_polls: LongPolls):
        self.store, self.config, self.clock, self.long_polls = store, config, clock, long_polls

    def claim(self, req: Signed) -> list[m.PendingGroup]:
        """Claim up to `limit` unclaimed pending groups for the signer for claim_ttl_s (waiting up to `wait_s`
        for one when there is none)."""

        def fetch() -> list[ClaimedGroup]:
            now = self.clock()
            return self.store.write(lambda tx: claim_pending(tx, req.signer, req.payload.limit, now,
                                                             now + self.config.claim_ttl_s))

        return [m.PendingGroup(group_id=r.id, node_id=r.node_id, prompt_text=r.prompt_text, answer=r.answer,
                               lease_version=r.lease_version, sampling=m.SamplingSpec.model_validate(r.sampling),
                               seeds=r.seeds, policy_version=r.policy_version,
                               group=m.RolloutGroup.model_validate(r.payload), node_checks_passed=r.node_checks_passed)
                for r in self.long_polls.wait(fetch, req.payload.wait_s)]

    def decide(self, req: Signed) -> None:
        """Apply a batch of verdicts (see the module docstring for what each does)."""
        batch: m.VerdictBatch = req.payload
        now = self.clock()

        def apply(tx: Tx) -> None:
            # Verdict batches take turns on the feed's counter row first (PostgreSQL): each then locks the rows it
            # changes in peace, and feed positions follow the order batches commit in.
            counter(tx, FEED_HEAD, lock=True)
            groups = lock_groups(tx, [v.group_id for v in batch.verdicts])
            for v in batch.verdicts:  # validate the whole batch first: a refused batch must change nothing
                grp = groups.get(v.group_id)
                if v.accepted and grp is not None and grp.status == "pending" and not grp.held:
                    n = len(grp.payload["rollouts"])
                    if len(v.rewards) != n:
                        raise Refused(422, f"group {v.group_id}: {len(v.rewards)} rewards for {n} rollouts")
                    if not all(math.isfinite(r) for r in v.rewards):
                        raise Refused(422, f"group {v.group_id}: rewards must be finite")
            for v in batch.verdicts:
                grp = get_group(tx, v.group_id)  # re-read: an earlier verdict (a release, a ban) may have decided it
                if grp is not None and grp.status == "pending" and not grp.held:
                    self._apply(tx, grp, v, now)

        self.store.write(apply, notify=True)

    @staticmethod
    def _apply(tx: Tx, grp: GroupRow, v: m.Verdict, now: float) -> None:
        if v.accepted and not v.checked:
            hold(tx, grp.id, list(v.rewards), now)
        elif v.accepted:
            released = release(tx, grp.node_id, grp.id, now)  # first: the feed then follows submission order
            accept(tx, grp.id, list(v.rewards), now)
            registry.count_check(tx, grp.node_id)
            registry.count_verdicts(tx, grp.node_id, accepted=1 + len(released))
        else:
            reason = (v.reason or "rejected by the verifier")[:MAX_REASON_CHARS]
            reject(tx, grp.id, reason, now)
            registry.count_verdicts(tx, grp.node_id, rejected=1)
            if v.ban:
                registry.ban(tx, grp.node_id, reason)
                dropped = reject_pending_of_node(tx, grp.node_id, "node banned", now)
                registry.count_verdicts(tx, grp.node_id, rejected=dropped)
