"""Admission: how many prompts an identity may hold, what counts as work in flight, and prompts leased again.

An identity's allowance (prompts leased and not yet submitted, at most) is earned by verified work, no faster than
time passes, and lost by abandoning prompts (`allowance`):

    grown       = min(prompts_per_accepted_group * groups_accepted, allowance_growth_per_s * age_s)
    earned      = min(max_identity_prompts, new_identity_prompts + grown - abandon_cost * prompts_abandoned)
    reliability = 1 - prompts_abandoned / (prompts_leased + abandon_prior)
    allowance   = max(1, floor(earned * reliability^2 * source_reliability^2))

`age_s` is the time since the identity registered; `source_reliability` is the same share over every identity
registered from its source (`InFlight.source_record`), so that a machine whose identities abandon what they lease
earns its next identity less. A burst of fast work earns no more than the time it took allows, and a lease left to
expire costs as many prompts of allowance as it held (the hoarder pays for what it held with as much work, and as much
time). No identity holds more than `max_identity_share` of the buffer (`identity_cap`), whatever it earned.

A new identity (free to make) holds `new_identity_prompts`; a node that hoards (leases and never submits) sees
its allowance fall to 1 within a few leases. A prompt is abandoned when its lease expires unsubmitted, when the
submission that settles its lease leaves it out, or when that submission's group for it is refused; every
abandoned prompt goes to `prompt_queue` and is leased again, with the seeds it had, to another identity before any
new prompt is drawn (`take_queued`): first to identities of another source than the one that abandoned it, and
after `same_source_after_s` to any other identity (a pool on one machine still trains on every prompt). So leaving
out the groups one does not like removes none of them from training: on the same policy version whoever generates
the prompt again reproduces the very group that was left out (the seeds fix the sampling), and a later version
draws it again from nearly the same policy.

Backpressure counts work in flight per identity (`in_flight`): the prompts leased to identities that have not yet
done `proven_after_groups` of verified work count at most `unproven_share` of `max_buffered_groups` (and never
more than `max_unproven_prompts`), and only unproven identities ever wait for it: the unproven identities
registered from one source hold at most an equal part of it among the sources holding some (`source_share`, and
at most `unproven_per_source`), and a source below its part is served even while the share is full. One identity,
or any number of fresh ones, cannot fill the buffer that proven nodes' leases are judged against, and machines
making identities cannot keep the newcomers of another address out: room freed in the share goes to sources below
their part, not to whoever asks most often. What is in flight is counted as leases open and
close (`coordinator.inflight`, which says how that differs from a recount): a lease request reads a few counter
rows, however many leases are open.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import BigInteger, Double, bindparam, delete, func, select, update

from swarmrl.coordinator import inflight
from swarmrl.coordinator.db.fast import Prepared
from swarmrl.coordinator.db.rows import NodeRow
from swarmrl.coordinator.db.schema import lease_prompts, leases, nodes, prompt_queue
from swarmrl.coordinator.db.store import Tx
from swarmrl.coordinator.inflight import InFlight


class AdmissionConfig(BaseModel):
    """Lease allowances per identity and the share of the buffer unproven identities may hold."""

    model_config = ConfigDict(extra="forbid")

    new_identity_prompts: int = Field(8, ge=1, description="Prompts in flight (leased, not submitted) a new "
                                      "identity may hold.")
    prompts_per_accepted_group: float = Field(1.0, ge=0, description="How much an identity's allowance grows with "
                                              "each of its groups the verifier accepted.")
    max_identity_prompts: int = Field(256, ge=1, description="Prompts in flight one identity may hold at most.")
    allowance_growth_per_s: float = Field(0.1, ge=0, description="How fast an identity's allowance may grow with "
                                          "time since it registered (prompts per second): verified work earns "
                                          "allowance no faster than this, so a burst of fast work cannot earn the "
                                          "whole buffer in seconds.")
    abandon_cost: float = Field(1.0, ge=0, description="Prompts of allowance an identity loses per prompt it "
                                "abandons: a lease left to expire costs in proportion to its size.")
    max_identity_share: float = Field(0.25, gt=0, le=1, description="Share of max_buffered_groups one identity may "
                                      "hold in flight, whatever it earned (never less than new_identity_prompts): "
                                      "a proven identity that turns to hoarding cannot take the buffer from the "
                                      "others.")
    source_abandon_prior: float = Field(16.0, gt=0, description="Smoothing of a source's abandoned share (over "
                                        "every identity registered from it), which bounds its identities' "
                                        "reliability as their own share does.")
    abandon_prior: float = Field(8.0, gt=0, description="Smoothing of the abandoned share: an identity's first "
                                 "abandoned prompts weigh less than a long record's.")
    proven_after_groups: int = Field(8, ge=0, description="Accepted groups after which an identity's leases count "
                                     "as a proven node's (not in the unproven share).")
    unproven_share: float = Field(0.5, gt=0, le=1, description="Share of max_buffered_groups the leases of unproven "
                                  "identities may hold together; past it, only they wait.")
    max_unproven_prompts: int = Field(1024, ge=1, description="Prompts in flight unproven identities may hold "
                                      "together at most (also without backpressure): free identities cannot make "
                                      "the lease tables grow without bound.")
    same_source_after_s: float = Field(600.0, ge=0, description="Seconds an abandoned prompt waits for an identity "
                                       "of another source before one of its abandoner's source may take it: the "
                                       "identities of one machine cannot pass a prompt among themselves until "
                                       "the outcome suits them.")
    unproven_per_source: int = Field(16, ge=1, description="Prompts in flight the unproven identities registered "
                                     "from one source (address, IPv6 /64) may hold together at most: identities "
                                     "made on one machine share this; with several sources holding unproven "
                                     "prompts, each holds at most an equal part of the unproven share "
                                     "(`source_share`), so one source cannot take the whole unproven share.")
    sweep_batch: int = Field(64, ge=1, description="Expired leases settled (their prompts queued again) per sweep: "
                             "once a second while none are left, and on every lease request while some are.")


def allowance(node: NodeRow, cfg: AdmissionConfig, source: tuple[int, int] | None = None) -> int:
    """Prompts in flight `node` may hold (module docstring), its age taken at its `last_seen` (a lease request
    touches it first). `source`: (prompts leased, prompts abandoned) by every identity of its source
    (`InFlight.source_record`); without it, its own record alone. Never less than 1, so that an honest node whose
    leases were lost can always earn its allowance back."""
    age = max(0.0, node.last_seen - node.registered_at)
    grown = min(cfg.prompts_per_accepted_group * node.groups_accepted, cfg.allowance_growth_per_s * age)
    # Abandoned prompts are taken from what was earned before the cap, so that a long record pays off an
    # occasional lost lease rather than sitting at the cap with its losses deducted for ever.
    earned = min(cfg.max_identity_prompts,
                 cfg.new_identity_prompts + math.floor(grown) - cfg.abandon_cost * node.prompts_abandoned)
    reliability = 1.0 - node.prompts_abandoned / (node.prompts_leased + cfg.abandon_prior)
    if source is not None:
        reliability = min(reliability, 1.0 - source[1] / (source[0] + cfg.source_abandon_prior))
    return max(1, math.floor(max(0.0, earned) * max(0.0, reliability) ** 2))


def identity_cap(cfg: AdmissionConfig, max_buffered: int | None) -> int:
    """Prompts in flight one identity may hold whatever its allowance: `max_identity_share` of the buffer, and
    never less than a new identity's allowance (a lone node in a small buffer keeps a full lease)."""
    if max_buffered is None:
        return cfg.max_identity_prompts
    return max(cfg.new_identity_prompts, math.ceil(cfg.max_identity_share * max_buffered))


def source_share(cfg: AdmissionConfig, cap: int, sources: int) -> int:
    """Prompts in flight the unproven identities of one source may hold together, while `sources` sources (the
    requester's included) hold unproven prompts: an equal part of the unproven share `cap`, at most
    `unproven_per_source`. A source below its part may lease up to it even while the share is full (the excess
    lasts until the others' leases close, and backpressure counts at most `cap` of it: `counted_in_flight`), so
    newcomers from a new address are served at once, however fast the sources already holding poll."""
    return max(1, min(cfg.unproven_per_source, cap // max(1, sources)))


def is_proven(node: NodeRow, cfg: AdmissionConfig) -> bool:
    return node.groups_accepted >= cfg.proven_after_groups


def unproven_cap(cfg: AdmissionConfig, max_buffered: int | None) -> int:
    """Prompts in flight all unproven identities together may hold."""
    if max_buffered is None:
        return cfg.max_unproven_prompts
    return max(1, min(cfg.max_unproven_prompts, math.ceil(cfg.unproven_share * max_buffered)))


def in_flight(tx: Tx, node: NodeRow, min_version: int, pending: dict[inflight.Key, int] | None = None) -> InFlight:
    """What is in flight, as seen by `node` (its row, read in this transaction) asking for a lease, with this
    transaction's `pending` counter moves (`coordinator.inflight`: a few counter rows, whatever the number of open
    leases)."""
    return inflight.read(tx, node, min_version, pending)


def counted_in_flight(flight: InFlight, cap: int) -> int:
    """The leased prompts backpressure counts: proven identities' in full, unproven ones' up to their cap."""
    return flight.proven + min(flight.unproven_usable, cap)


# -- abandoned prompts ------------------------------------------------------------------------------------

_p, _l, _n, _q = lease_prompts.c, leases.c, nodes.c, prompt_queue.c
_now = bindparam("b_now", type_=Double)
_EXPIRED = (select(_l.id).where(_l.state == "open", _l.expires_at <= _now).order_by(_l.expires_at)
            .limit(bindparam("b_limit")).with_for_update(skip_locked=True))
_OWN_EXPIRED = Prepared(select(_l.id).where(_l.node_id == bindparam("b_node"), _l.state == "open",
                                            _l.expires_at <= _now)
                        .order_by(_l.expires_at).limit(bindparam("b_limit")).with_for_update(skip_locked=True))
_UNUSED = Prepared(select(_p.text, _p.answer, _p.seeds).where(_p.lease_id == bindparam("b_lease"),
                                                              _p.submitted.is_(False)))
_SOURCE = Prepared(select(_n.source).where(_n.id == bindparam("b_node")))
_CLOSE = Prepared(update(leases).where(_l.id == bindparam("b_lease"), _l.state == "open").values(state="done")
                  .returning(_l.node_id, _l.policy_version, _l.flight_class, _l.flight_source, _l.flight_stripe,
                             _l.flight_n))
_SETTLED = Prepared(update(nodes).where(_n.id == bindparam("b_node")).values(
    prompts_abandoned=_n.prompts_abandoned + bindparam("b_abandoned", type_=BigInteger),
    in_flight=_n.in_flight - bindparam("b_flight", type_=BigInteger)))
_QUEUED = Prepared(select(_q.id, _q.text, _q.answer, _q.seeds).where(
    _q.abandoned_by != bindparam("b_node"),
    (_q.abandoned_source != bindparam("b_source")) | (_q.queued_at <= bindparam("b_before", type_=Double)))
    .order_by(_q.id).limit(bindparam("b_limit")).with_for_update(skip_locked=True))
Queued = tuple[str, str, list[int] | None]
"""A prompt leased again: (text, answer, its seeds; None: fresh ones)."""


@dataclass
class Settlement:
    """What closing leases moves, not yet applied (`close_leases`)."""

    nodes: dict[str, list[int]] = field(default_factory=dict)
    """Per node: [prompts it abandoned, prompts no longer in flight]."""
    counters: dict[inflight.Key, int] = field(default_factory=dict)
    """The counter rows' moves (`inflight.apply`)."""
    queued: int = 0
    """Prompts queued to be leased again."""


def close_leases(tx: Tx, lease_ids: list[str], now: float, *, penalise: bool = True,
                 unused: dict[str, list[Queued]] | None = None) -> Settlement:
    """Close the open leases among `lease_ids` and queue their prompts not submitted (a lease not open changes
    nothing); what that moves, counted as abandoned by their node unless `penalise` is False, for the caller to apply
    (`settle_leases` says how). `unused`: a lease's prompts not submitted (text, answer), when the caller read them
    in this transaction (text, answer, seeds); the others' are read here."""
    settled = Settlement()
    for lease_id in lease_ids:
        closed = _CLOSE.first(tx, b_lease=lease_id)
        if closed is None:
            continue
        node_id, version, cls, source, stripe, n = closed
        left = unused[lease_id] if unused is not None and lease_id in unused else _UNUSED.all(tx, b_lease=lease_id)
        if left:
            abandoner = _SOURCE.first(tx, b_node=node_id)
            tx.execute(prompt_queue.insert(), [
                {"text": t, "answer": a, "seeds": seeds, "abandoned_by": node_id, "queued_at": now,
                 "abandoned_source": abandoner[0] if abandoner is not None else ""} for t, a, seeds in left])
        counts = settled.nodes.setdefault(node_id, [0, 0])
        counts[0] += len(left) if penalise else 0
        counts[1] += n
        inflight.add_to(settled.counters, cls, source, version, stripe, -n)
        settled.queued += len(left)
    return settled


def settle_leases(tx: Tx, lease_ids: list[str], now: float, *, penalise: bool = True,
                  deltas: dict[inflight.Key, int] | None = None) -> int:
    """Close the open leases among `lease_ids` (`close_leases`) and apply what that moves; how many prompts were
    queued. Nodes' rows are moved in node-id order and the counter rows after them, in key order
    (`inflight.apply`; into `deltas` instead when given, for the caller to apply), so that two settlements never
    wait on each other's rows in opposite orders."""
    settled = close_leases(tx, lease_ids, now, penalise=penalise)
    for node_id in sorted(settled.nodes):
        abandoned, flight = settled.nodes[node_id]
        if abandoned or flight:
            _SETTLED.rowcount(tx, b_node=node_id, b_abandoned=abandoned, b_flight=flight)
    if deltas is None:
        inflight.apply(tx, settled.counters)
    else:
        for key, d in settled.counters.items():
            deltas[key] = deltas.get(key, 0) + d
    return settled.queued


def settle_lease(tx: Tx, lease_id: str, now: float, *, penalise: bool = True) -> int:
    """`settle_leases` of one lease."""
    return settle_leases(tx, [lease_id], now, penalise=penalise)


def expired_leases(tx: Tx, now: float, limit: int) -> list[str]:
    """Up to `limit` open leases that expired, oldest first, locked (rows others are settling are skipped)."""
    return [r.id for r in tx.execute(_EXPIRED, {"b_now": now, "b_limit": limit})]


def sweep_expired(tx: Tx, now: float, limit: int) -> int:
    """Settle up to `limit` open leases that expired (`expired_leases`): their unsubmitted prompts are queued and
    count as abandoned by their node. How many prompts were queued."""
    return settle_leases(tx, expired_leases(tx, now, limit), now)


def settle_own_expired(tx: Tx, node_id: str, now: float, limit: int, deltas: dict[inflight.Key, int]) -> int:
    """Settle up to `limit` of `node_id`'s open leases that expired (as `sweep_expired`; rows a sweep is settling are
    skipped), their counter moves into `deltas`; how many. Its row must be locked by this transaction."""
    ids = [r[0] for r in _OWN_EXPIRED.all(tx, b_node=node_id, b_now=now, b_limit=limit)]
    settle_leases(tx, ids, now, deltas=deltas)
    return len(ids)


def take_queued(tx: Tx, node_id: str, source: str, limit: int, now: float, same_source_after_s: float
                ) -> list[Queued]:
    """Up to `limit` queued prompts (text, answer, seeds), oldest first, that `node_id` (registered from `source`)
    may take, taken out of the queue: not those it abandoned, and those an identity of its source abandoned only
    once they have waited `same_source_after_s`."""
    rows = _QUEUED.all(tx, b_node=node_id, b_source=source, b_before=now - same_source_after_s, b_limit=limit)
    if rows:
        tx.execute(delete(prompt_queue).where(_q.id.in_([r[0] for r in rows])))
    return [(text, answer, seeds) for _, text, answer, seeds in rows]


def queued(tx: Tx) -> int:
    """Prompts waiting to be leased again."""
    return int(tx.execute(select(func.count()).select_from(prompt_queue)).scalar_one())
