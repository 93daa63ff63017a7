"""Verification: the pending queue, verifiers' claims, verdicts, and the whole quarantine state machine.

A submitted group's life from here on (`rollout_groups.status`, `held`):

    pending --claim---------------------------> pending, claimed (until claimed_until; then claimable again)
    pending --verdict: accepted, checked------> accepted (a feed position), after RELEASE of its node
    pending --verdict: accepted, not checked--> HELD (pending, held; trusted rewards kept; not claimable)
    pending --verdict: rejected---------------> rejected; with `ban`: BAN of its node
    HELD    --RELEASE-------------------------> accepted (a feed position)
    HELD    --BAN-----------------------------> rejected ("node banned")

    RELEASE of node n at group g (`protocol.quarantine.on_pass`): if the check of g vouches (`Verdict.vouches`:
            drawn, not forced by the held cap), each of n's held groups submitted before g gets a vouch; those with
            `release_passes` vouches are accepted, oldest first, before g itself.
    BAN of node n: n is banned (for good); every pending group of n, held or not, is rejected. A verdict that bans
            bans whatever verdict on its group landed first: a failed check is final.

A group's draw is made at its first claim and kept (`claim_pending`): a re-claim is judged with the same number.

The verifier's policy only says whether it ran the full check (`Verdict.checked`) and whether that check vouches;
when a held group is released or dropped is decided here, by the rule of `protocol.quarantine` (its bound:
docs/quarantine.md). Verdicts on groups already decided, held, or unknown are ignored, bans aside, so
a retried or duplicated batch changes nothing. A batch is validated whole before any of it is applied.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import replace

from sqlalchemy import BigInteger, Double, bindparam, func, select, update

from swarmrl.coordinator import feed, registry
from swarmrl.coordinator.auth import Refused, Signed
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.rows import ClaimedGroup, GroupRow
from swarmrl.coordinator.db.schema import FEED_HEAD, VERIFIER_SEEN_AT, lease_prompts, leases, nodes, rollout_groups
from swarmrl.coordinator.db.store import Store, Tx, counter, load, raise_counter
from swarmrl.coordinator.gate import admit
from swarmrl.coordinator.idempotency import remember
from swarmrl.coordinator.longpoll import LongPolls
from swarmrl.protocol import messages as m
from swarmrl.protocol import quarantine
from swarmrl.protocol.refusals import RefusalCode

MAX_REASON_CHARS = 1000

# -- queries ----------------------------------------------------------------------------------------------

g = rollout_groups.c
_ids = bindparam("b_ids", expanding=True)
_GET = select(rollout_groups).where(g.id == bindparam("b_id"))
_LOCK = select(rollout_groups).where(g.id.in_(_ids)).order_by(g.id).with_for_update()
_CLAIMABLE = select(g.id).where(g.status == "pending", g.held.is_(False),
                                g.claimed_until.is_(None) | (g.claimed_until < bindparam("b_now", type_=Double))
                                ).order_by(g.id).limit(bindparam("b_limit")).with_for_update(skip_locked=True)
_CLAIM = update(rollout_groups).where(g.id.in_(_ids)).values(claimed_by=bindparam("b_by"),
                                                             claimed_until=bindparam("b_until", type_=Double))
_p, _l, _n = lease_prompts.c, leases.c, nodes.c
_h = rollout_groups.alias("held_groups")
_CLAIMED = (select(g.id, g.node_id, g.policy_version, g.payload, g.lease_id, g.prompt_id, _p.text.label("prompt_text"),
                   _p.answer, _p.seeds, _p.position, _l.policy_version.label("lease_version"), _l.expires_at,
                   _l.sampling, _l.signature, _l.digests, _n.checks_passed.label("node_checks_passed"),
                   _n.source.label("node_source"), _n.public_key.label("node_key"),
                   select(func.count()).select_from(_h).where(_h.c.node_id == g.node_id, _h.c.status == "pending",
                                                              _h.c.held.is_(True)).scalar_subquery().label("node_held"),
                   g.draw, g.draw_passes, g.draw_held)
            .select_from(rollout_groups.join(lease_prompts, (_p.lease_id == g.lease_id) & (_p.prompt_id == g.prompt_id))
                         .join(leases, _l.id == g.lease_id).join(nodes, _n.id == g.node_id))
            .where(g.id.in_(_ids)).order_by(g.id))
_KEEP_DRAW = update(rollout_groups).where(g.id == bindparam("b_id"), g.draw.is_(None)).values(
    draw=bindparam("b_draw", type_=Double), draw_passes=bindparam("b_passes"), draw_held=bindparam("b_held"))
_PENDING_LOCKED = select(g.id).where(g.id == bindparam("b_id"), g.status == "pending").with_for_update()
_decided = {"decided_at": bindparam("b_now", type_=Double), "claimed_until": None}
_ACCEPT = update(rollout_groups).where(g.id == bindparam("b_id")).values(
    status="accepted", rewards=bindparam("b_rewards", type_=g.rewards.type),
    accepted_seq=bindparam("b_seq", type_=BigInteger), held=False, **_decided)
_HOLD = update(rollout_groups).where(g.id == bindparam("b_id"), g.status == "pending", g.held.is_(False)).values(
    held=True, rewards=bindparam("b_rewards", type_=g.rewards.type), **_decided)
_HELD = (select(g.id, g.rewards, g.vouches).where(g.node_id == bindparam("b_node"), g.status == "pending",
                                                  g.held.is_(True))
         .order_by(g.id).with_for_update())
_VOUCH = update(rollout_groups).where(g.id == bindparam("b_id")).values(vouches=bindparam("b_vouches"))
_STATE = select(g.status, g.held).where(g.id == bindparam("b_id"))
_REJECT = update(rollout_groups).where(g.id == bindparam("b_id"), g.status == "pending").values(
    status="rejected", reason=bindparam("b_reason"), **_decided)
_REJECT_NODE = update(rollout_groups).where(g.node_id == bindparam("b_node"), g.status == "pending").values(
    status="rejected", reason=bindparam("b_reason"), **_decided)


def get_group(tx: Tx, group_id: int) -> GroupRow | None:
    row = tx.execute(_GET, {"b_id": group_id}).first()
    return load(GroupRow, row) if row is not None else None


def lock_groups(tx: Tx, group_ids: list[int]) -> dict[int, GroupRow]:
    """The groups with these ids, locked until the transaction ends (in id order, so no two lockers deadlock)."""
    return {r.id: load(GroupRow, r) for r in tx.execute(_LOCK, {"b_ids": sorted(set(group_ids))})}


def claim_pending(tx: Tx, claimer: str, limit: int, now: float, until: float,
                  draw: Callable[[], float]) -> list[ClaimedGroup]:
    """Claim up to `limit` pending, unheld groups nobody holds a live claim on, oldest first, with their lease
    facts. Rows another transaction has locked (being claimed or decided) are skipped, not waited for.

    A group's draw is final: at its first claim it gets `draw()` and the node's passed checks and held groups as
    they stand, stored; every later claim returns those (the claimed group's `draw`, `draw_passes`, `draw_held`),
    so a check that outlasts its claim, or a crashed verifier, cannot have the group drawn again."""
    ids = list(tx.execute(_CLAIMABLE, {"b_now": now, "b_limit": limit}).scalars())
    if not ids:
        return []
    tx.execute(_CLAIM, {"b_ids": ids, "b_by": claimer, "b_until": until})
    rows = [load(ClaimedGroup, r) for r in tx.execute(_CLAIMED, {"b_ids": ids})]
    first = [replace(r, draw=draw(), draw_passes=r.node_checks_passed, draw_held=r.node_held)
             for r in rows if r.draw is None]
    if first:
        tx.execute(_KEEP_DRAW, [{"b_id": r.id, "b_draw": r.draw, "b_passes": r.draw_passes, "b_held": r.draw_held}
                                for r in first])
    drawn = {r.id: r for r in first}
    return [drawn.get(r.id, r) for r in rows]


def lease_excerpt(r: ClaimedGroup) -> m.LeaseExcerpt:
    """The signed lease excerpt a claimed group is judged against, rebuilt from what was stored when it was signed
    (a lease from before signed leases has no signature: its excerpt will not verify, and the verifier says so)."""
    return m.LeaseExcerpt(lease_id=r.lease_id, node_id=r.node_id, policy_version=r.lease_version,
                          expires_at=r.expires_at, sampling=m.SamplingSpec.model_validate(r.sampling),
                          prompt=m.LeasedPrompt(prompt_id=r.prompt_id, text=r.prompt_text, seeds=r.seeds),
                          index=r.position, digests=r.digests or [""],
                          signature=r.signature or _UNSIGNED)


_UNSIGNED = {"v": "", "kind": "", "pool": "", "key": "0" * 64, "nonce": "0" * 32, "ts": 0.0, "body": "0" * 64,
             "sig": "0" * 128}


def accept(tx: Tx, group_id: int, rewards: list[float], now: float) -> int | None:
    """Accept a pending group at the next feed position, which is returned; None (and no position used) if the
    group is not pending."""
    if tx.execute(_PENDING_LOCKED, {"b_id": group_id}).first() is None:
        return None
    seq = feed.next_position(tx)
    tx.execute(_ACCEPT, {"b_id": group_id, "b_rewards": rewards, "b_seq": seq, "b_now": now})
    return seq


def hold(tx: Tx, group_id: int, rewards: list[float], now: float) -> bool:
    """Hold a pending, unheld group with its trusted rewards; False if it is not such a group."""
    return tx.execute(_HOLD, {"b_id": group_id, "b_rewards": rewards, "b_now": now}).rowcount == 1


def release(tx: Tx, node_id: str, passed_id: int, now: float, vouches: bool = True,
            release_passes: int = quarantine.RELEASE_PASSES) -> list[int]:
    """A full check of the node's group `passed_id` passed: apply `protocol.quarantine.on_pass` to its held groups
    (new vouch counts stored) and accept, oldest first, those it releases; their ids."""
    held = {r.id: r for r in tx.execute(_HELD, {"b_node": node_id}).all()}
    out = quarantine.on_pass([quarantine.Held(r.id, r.vouches) for r in held.values()], passed_id, vouches,
                             release_passes)
    for h in out.still_held:
        if h.vouches != held[h.group_id].vouches:
            tx.execute(_VOUCH, {"b_id": h.group_id, "b_vouches": h.vouches})
    return [gid for gid in out.released if accept(tx, gid, held[gid].rewards, now) is not None]


def reject(tx: Tx, group_id: int, reason: str, now: float) -> bool:
    return tx.execute(_REJECT, {"b_id": group_id, "b_reason": reason, "b_now": now}).rowcount == 1


def reject_pending_of_node(tx: Tx, node_id: str, reason: str, now: float) -> int:
    """Reject every still-pending group of a node, held ones included; how many."""
    return tx.execute(_REJECT_NODE, {"b_node": node_id, "b_reason": reason, "b_now": now}).rowcount


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
        self._draws = random.SystemRandom() if config.draw_seed is None else random.Random(config.draw_seed)
        self.accept_hooks: list[Callable[[Tx, list[int], float], object]] = []
        """Called with the ids of the groups a verdict batch accepted (released ones included), inside the batch's
        transaction, before it commits (the ledger signs their receipts there)."""

    def claim(self, req: Signed) -> m.PendingGroups:
        """Claim up to `limit` unclaimed pending groups for the signer for claim_ttl_s (waiting up to `wait_s`
        for one when there is none)."""
        admitted = False

        def fetch() -> list[m.PendingGroup]:
            nonlocal admitted
            now = self.clock()

            def take(tx: Tx) -> list[m.PendingGroup]:
                if not admitted:  # the first try of a long poll: the nonce (and a retry's stored answer)
                    admit(tx, req)
                raise_counter(tx, VERIFIER_SEEN_AT, int(now))  # the watchdog's: a verifier is at work
                rows = claim_pending(tx, req.signer, req.payload.limit, now, now + self.config.claim_ttl_s,
                                     self._draws.random)
                groups = [m.PendingGroup(
                    group_id=r.id, node_id=r.node_id, node_key=r.node_key, answer=r.answer, lease=lease_excerpt(r),
                    policy_version=r.policy_version, group=m.RolloutGroup.model_validate(r.payload),
                    node_checks_passed=r.draw_passes, node_held=r.draw_held, draw=r.draw,
                    node_source=r.node_source[:256]) for r in rows]
                if groups:  # an empty answer claimed nothing: a retry may as well look again
                    remember(tx, req, m.PendingGroups(groups=groups), now)
                return groups

            # Not durable: a claim lost with a power cut only makes its groups claimable again.
            groups = self.store.write(take, durable=False)
            admitted = True
            return groups

        return m.PendingGroups(groups=self.long_polls.wait(fetch, req.payload.wait_s))

    def decide(self, req: Signed) -> None:
        """Apply a batch of verdicts (see the module docstring for what each does)."""
        batch: m.VerdictBatch = req.payload
        now = self.clock()

        def apply(tx: Tx) -> None:
            admit(tx, req)
            # Verdict batches take turns on the feed's counter row first (PostgreSQL): each then locks the rows it
            # changes in peace, and feed positions follow the order batches commit in.
            counter(tx, FEED_HEAD, lock=True)
            groups = lock_groups(tx, [v.group_id for v in batch.verdicts])
            for v in batch.verdicts:  # validate the whole batch first: a refused batch must change nothing
                grp = groups.get(v.group_id)
                if v.accepted and grp is not None and grp.status == "pending" and not grp.held:
                    n = len(grp.payload["rollouts"])
                    if len(v.rewards) != n:
                        raise Refused(RefusalCode.INVALID_VERDICT,
                                      f"group {v.group_id}: {len(v.rewards)} rewards for {n} rollouts")
                    if not all(math.isfinite(r) for r in v.rewards):
                        raise Refused(RefusalCode.INVALID_VERDICT, f"group {v.group_id}: rewards must be finite")
            counts: dict[str, list[int]] = {}  # node id -> [accepted, rejected, checks passed], added at the end
            accepted: list[int] = []
            for v in batch.verdicts:
                grp = groups.get(v.group_id)
                if grp is None:
                    continue
                # Re-read: an earlier verdict of this batch (a release, a ban) may have decided it.
                status, held = tx.execute(_STATE, {"b_id": grp.id}).one()
                if status == "pending" and not held:
                    accepted += self._apply(tx, grp, v, now, counts.setdefault(grp.node_id, [0, 0, 0]),
                                            self.config.release_passes)
                elif v.ban and not v.accepted:
                    # A failed check is final whatever verdict on this group landed first (a second verifier's,
                    # on a group re-claimed while this check ran): the ban still drops what is unreleased.
                    counts.setdefault(grp.node_id, [0, 0, 0])[1] += _ban(tx, grp.node_id, _reason(v), now)
            for node_id, (n_accepted, n_rejected, checks) in counts.items():
                registry.count_verdicts(tx, node_id, accepted=n_accepted, rejected=n_rejected, checks=checks)
            for hook in self.accept_hooks:
                hook(tx, accepted, now)
            remember(tx, req, None, now)

        self.store.write(apply, notify=True)

    @staticmethod
    def _apply(tx: Tx, grp: GroupRow, v: m.Verdict, now: float, counts: list[int], release_passes: int) -> list[int]:
        """One verdict on a pending, unheld group; `counts` (the node's [accepted, rejected, checks]) grows. The ids
        of the groups it accepted."""
        if v.accepted and not v.checked:
            hold(tx, grp.id, list(v.rewards), now)
        elif v.accepted:
            # First: the feed then follows submission order.
            released = release(tx, grp.node_id, grp.id, now, v.vouches, release_passes)
            accept(tx, grp.id, list(v.rewards), now)
            counts[0] += 1 + len(released)
            counts[2] += 1
            return [*released, grp.id]
        else:
            reject(tx, grp.id, _reason(v), now)
            counts[1] += 1
            if v.ban:
                counts[1] += _ban(tx, grp.node_id, _reason(v), now)
        return []


def _reason(v: m.Verdict) -> str:
    return (v.reason or "rejected by the verifier")[:MAX_REASON_CHARS]


def _ban(tx: Tx, node_id: str, reason: str, now: float) -> int:
    """Ban a node (its first ban's reason stays) and reject every group of it still pending; how many."""
    registry.ban(tx, node_id, reason)
    return reject_pending_of_node(tx, node_id, "node banned", now)
