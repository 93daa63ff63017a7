"""Admission: how many prompts an identity may hold, what counts as work in flight, and prompts leased again.

An identity's allowance (prompts leased and not yet submitted, at most) is earned by verified work and lost by
abandoning prompts (`allowance`):

    earned      = min(max_identity_prompts, new_identity_prompts + prompts_per_accepted_group * groups_accepted)
    reliability = 1 - prompts_abandoned / (prompts_leased + abandon_prior)
    allowance   = max(1, floor(earned * reliability^2))

A new identity (free to make) holds `new_identity_prompts`; a node that hoards (leases and never submits) sees
its allowance fall to 1 within a few leases. A prompt is abandoned when its lease expires unsubmitted, when the
submission that settles its lease leaves it out, or when that submission's group for it is refused; every
abandoned prompt goes to `prompt_queue` and is leased again, with fresh seeds, to another identity before any new
prompt is drawn (`take_queued`). So leaving out the prompts one does not like removes none of them from training.

Backpressure counts work in flight per identity (`in_flight`): the prompts leased to identities that have not yet
done `proven_after_groups` of verified work count at most `unproven_share` of `max_buffered_groups` (and never
more than `max_unproven_prompts`), and while that share is taken only unproven identities wait; the unproven
identities registered from one source hold at most `unproven_per_source` of it together. One identity, or any
number of fresh ones, cannot fill the buffer that proven nodes' leases are judged against, and one machine making
identities cannot take the newcomers' share from the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Double, bindparam, case, delete, func, select, update

from swarmrl.coordinator.db.rows import NodeRow
from swarmrl.coordinator.db.schema import lease_prompts, leases, nodes, prompt_queue
from swarmrl.coordinator.db.store import Tx


class AdmissionConfig(BaseModel):
    """Lease allowances per identity and the share of the buffer unproven identities may hold."""

    model_config = ConfigDict(extra="forbid")

    new_identity_prompts: int = Field(8, ge=1, description="Prompts in flight (leased, not submitted) a new "
                                      "identity may hold.")
    prompts_per_accepted_group: float = Field(1.0, ge=0, description="How much an identity's allowance grows with "
                                              "each of its groups the verifier accepted.")
    max_identity_prompts: int = Field(256, ge=1, description="Prompts in flight one identity may hold at most.")
    abandon_prior: float = Field(8.0, gt=0, description="Smoothing of the abandoned share: an identity's first "
                                 "abandoned prompts weigh less than a long record's.")
    proven_after_groups: int = Field(8, ge=0, description="Accepted groups after which an identity's leases count "
                                     "as a proven node's (not in the unproven share).")
    unproven_share: float = Field(0.5, gt=0, le=1, description="Share of max_buffered_groups the leases of unproven "
                                  "identities may hold together; past it, only they wait.")
    max_unproven_prompts: int = Field(1024, ge=1, description="Prompts in flight unproven identities may hold "
                                      "together at most (also without backpressure): free identities cannot make "
                                      "the lease tables grow without bound.")
    unproven_per_source: int = Field(16, ge=1, description="Prompts in flight the unproven identities registered "
                                     "from one source (address, IPv6 /64) may hold together: identities made on one "
                                     "machine share this, so one source cannot take the whole unproven share.")
    sweep_batch: int = Field(64, ge=1, description="Expired leases settled (their prompts queued again) per lease "
                             "request.")


def allowance(node: NodeRow, cfg: AdmissionConfig) -> int:
    """Prompts in flight `node` may hold (module docstring)."""
    earned = min(cfg.max_identity_prompts,
                 cfg.new_identity_prompts + math.floor(cfg.prompts_per_accepted_group * node.groups_accepted))
    reliability = max(0.0, 1.0 - node.prompts_abandoned / (node.prompts_leased + cfg.abandon_prior))
    return max(1, math.floor(earned * reliability ** 2))


def is_proven(node: NodeRow, cfg: AdmissionConfig) -> bool:
    return node.groups_accepted >= cfg.proven_after_groups


def unproven_cap(cfg: AdmissionConfig, max_buffered: int | None) -> int:
    """Prompts in flight all unproven identities together may hold."""
    if max_buffered is None:
        return cfg.max_unproven_prompts
    return max(1, min(cfg.max_unproven_prompts, math.ceil(cfg.unproven_share * max_buffered)))


@dataclass(frozen=True)
class InFlight:
    """Prompts leased and not submitted, in open unexpired leases."""

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


_p, _l, _n, _q = lease_prompts.c, leases.c, nodes.c, prompt_queue.c
_now = bindparam("b_now", type_=Double)
_proven = (_n.groups_accepted >= bindparam("b_proven")).label("proven")
_usable = (_l.policy_version >= bindparam("b_min")).label("usable")
_same = (_n.source == bindparam("b_source")).label("same")
_IN_FLIGHT = (select(case((_l.node_id == bindparam("b_me"), 1), else_=0).label("mine"), _proven, _usable, _same,
                     func.count().label("n"))
              .select_from(lease_prompts.join(leases, _l.id == _p.lease_id).join(nodes, _n.id == _l.node_id))
              .where(_p.submitted.is_(False), _l.state == "open", _l.expires_at > _now)
              .group_by("mine", "proven", "usable", "same"))


def in_flight(tx: Tx, node: NodeRow, now: float, min_version: int, cfg: AdmissionConfig) -> InFlight:
    """What is in flight, as seen by `node` asking for a lease."""
    own = proven = unproven = unproven_usable = same_source = 0
    for mine, prv, usable, same, n in tx.execute(_IN_FLIGHT, {
            "b_me": node.id, "b_now": now, "b_min": min_version, "b_proven": cfg.proven_after_groups,
            "b_source": node.source}):
        own += n if mine else 0
        if prv:
            proven += n if usable else 0
        else:
            unproven += n
            unproven_usable += n if usable else 0
            same_source += n if same else 0
    return InFlight(own, proven, unproven, unproven_usable, same_source)


def counted_in_flight(flight: InFlight, cap: int) -> int:
    """The leased prompts backpressure counts: proven identities' in full, unproven ones' up to their cap."""
    return flight.proven + min(flight.unproven_usable, cap)


# -- abandoned prompts ------------------------------------------------------------------------------------

_EXPIRED = (select(_l.id, _l.node_id).where(_l.state == "open", _l.expires_at <= _now).order_by(_l.expires_at)
            .limit(bindparam("b_limit")).with_for_update(skip_locked=True))
_UNUSED = select(_p.text, _p.answer).where(_p.lease_id == bindparam("b_lease"), _p.submitted.is_(False))
_SETTLE = update(leases).where(_l.id == bindparam("b_lease"), _l.state == "open").values(state="done")
_ABANDONED = update(nodes).where(_n.id == bindparam("b_node")).values(
    prompts_abandoned=_n.prompts_abandoned + bindparam("b_n"))
_LEASED = update(nodes).where(_n.id == bindparam("b_node")).values(prompts_leased=_n.prompts_leased + bindparam("b_n"))
_QUEUED = (select(_q.id, _q.text, _q.answer).where(_q.abandoned_by != bindparam("b_node")).order_by(_q.id)
           .limit(bindparam("b_limit")).with_for_update(skip_locked=True))


def count_leased(tx: Tx, node_id: str, n: int) -> None:
    tx.execute(_LEASED, {"b_node": node_id, "b_n": n})


def _requeue(tx: Tx, lease_id: str, node_id: str, now: float) -> int:
    """Close an open lease and queue its prompts not submitted; how many (0, nothing changed, if it is not open)."""
    if tx.execute(_SETTLE, {"b_lease": lease_id}).rowcount != 1:
        return 0
    unused = [(r.text, r.answer) for r in tx.execute(_UNUSED, {"b_lease": lease_id})]
    if unused:
        tx.execute(prompt_queue.insert(), [{"text": t, "answer": a, "abandoned_by": node_id, "queued_at": now}
                                           for t, a in unused])
    return len(unused)


def count_abandoned(tx: Tx, node_id: str, n: int) -> None:
    if n:
        tx.execute(_ABANDONED, {"b_node": node_id, "b_n": n})


def settle_lease(tx: Tx, lease_id: str, node_id: str, now: float, *, penalise: bool = True) -> int:
    """Close an open lease: its prompts not submitted go to the queue, counted as abandoned by `node_id` unless
    `penalise` is False; how many. 0 (and nothing changed) if the lease is not open."""
    n = _requeue(tx, lease_id, node_id, now)
    if penalise:
        count_abandoned(tx, node_id, n)
    return n


def sweep_expired(tx: Tx, now: float, limit: int) -> int:
    """Settle up to `limit` open leases that expired (oldest first; rows others are settling are skipped): their
    unsubmitted prompts are queued and count as abandoned by their node. How many prompts were queued. Nodes'
    counters are moved in node-id order, so that two sweeps never wait on each other's node rows."""
    per_node: dict[str, int] = {}
    for r in tx.execute(_EXPIRED, {"b_now": now, "b_limit": limit}).all():
        per_node[r.node_id] = per_node.get(r.node_id, 0) + _requeue(tx, r.id, r.node_id, now)
    for node_id in sorted(per_node):
        count_abandoned(tx, node_id, per_node[node_id])
    return sum(per_node.values())


def take_queued(tx: Tx, node_id: str, limit: int) -> list[tuple[str, str]]:
    """Up to `limit` queued prompts (text, answer), oldest first, that `node_id` did not abandon; taken out of the
    queue."""
    rows = tx.execute(_QUEUED, {"b_node": node_id, "b_limit": limit}).all()
    if rows:
        tx.execute(delete(prompt_queue).where(_q.id.in_([r.id for r in rows])))
    return [(r.text, r.answer) for r in rows]


def queued(tx: Tx) -> int:
    """Prompts waiting to be leased again."""
    return int(tx.execute(select(func.count()).select_from(prompt_queue)).scalar_one())
