"""The coordinator's lease desk in virtual time: lease sizing, admission and backpressure, decided by the real
functions of `coordinator.admission` and `coordinator.inflight` on the real row and counter types.

What is an adapter here, and why: the order in which the coordinator applies those functions lives in
`Leases._grant` (coordinator/leases.py), inside a database transaction, in a file another change is editing
now; `grant` below repeats that order (allowance within the identity's share of the buffer, open leases, its
source's part of the unproven share, then backpressure against `max_buffered_groups`) over in-memory counters
instead of the counter rows, and calls the same pure functions for every figure (`allowance`, `identity_cap`,
`is_proven`, `unproven_cap`, `source_share`, `counted_in_flight`, `inflight.counted_as`, `InFlight`). One gap:
newcomers waiting for room are woken (`room`) only when the unproven share has room, where the coordinator serves
a source below its part at its next request even while the share is full.

What the counter rows hold (prompts in flight per class, version and source; submitted groups waiting for a
verdict or accepted and not yet read by the trainer, per version: `leasequeries.buffered_groups`, held groups not
counted) is kept here as the coordinator keeps it, moved when a lease opens and when it closes
(`coordinator.inflight`'s docstring).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from swarmrl.coordinator import admission, inflight
from swarmrl.coordinator.admission import AdmissionConfig
from swarmrl.coordinator.db.rows import NodeRow
from swarmrl.protocol.quarantine import Held


@dataclass(eq=False)
class Identity:
    """One node key as the coordinator and the verifier know it."""

    id: str
    source: str
    adversary: bool = False
    registered_at: float = 0.0
    groups_accepted: int = 0
    prompts_leased: int = 0
    prompts_abandoned: int = 0
    in_flight: int = 0
    checks_passed: int = 0
    banned: bool = False
    held: list[Held] = field(default_factory=list)
    cheats: set[int] = field(default_factory=set)
    """Ids of its cheating groups not yet decided or released (the attacker's own knowledge)."""
    pending: dict[int, object] = field(default_factory=dict)
    """Its submitted groups not yet accepted or rejected, by id."""

    def row(self, now: float) -> NodeRow:
        """Its `nodes` row at `now` (a lease request touches it first), as `coordinator.admission` reads it."""
        return NodeRow(id=self.id, public_key=self.id, name=self.id, engine="sim", registered_at=self.registered_at,
                       last_seen=now,
                       held_version=-1, banned=self.banned, ban_reason="", groups_accepted=self.groups_accepted,
                       groups_rejected=0, reputation=0.0, checks_passed=self.checks_passed, idle_s=0.0, busy_s=0.0,
                       idle_total=0.0, busy_total=0.0, counters_at=None, prompts_leased=self.prompts_leased,
                       prompts_abandoned=self.prompts_abandoned, source=self.source)


@dataclass(eq=False)
class Lease:
    ident: Identity
    n: int
    version: int
    expires_at: float
    counted: tuple[str, str]
    open: bool = True


REFUSED_ALLOWANCE = "allowance"
WAIT_UNPROVEN = "unproven share"
WAIT_BACKPRESSURE = "backpressure"


class Desk:
    """Leases and the counts backpressure reads."""

    def __init__(self, adm: AdmissionConfig, max_buffered: int | None, max_staleness: int, lease_ttl_s: float):
        self.adm, self.max_buffered, self.k, self.ttl = adm, max_buffered, max_staleness, lease_ttl_s
        self.cap = admission.unproven_cap(adm, max_buffered)
        self.flight: dict[str, Counter[int]] = {inflight.PROVEN: Counter(), inflight.UNPROVEN: Counter()}
        self.by_source: Counter[str] = Counter()
        self.source_record: dict[str, list[int]] = {}
        """Per source: [prompts leased, prompts abandoned] by its identities (`admission.source_record`)."""
        self.buffered: Counter[int] = Counter()
        """Groups waiting for a verdict, or accepted and not yet read by the trainer, per policy version
        (`leasequeries.buffered_groups`)."""
        self.queued = 0
        """Abandoned prompts waiting to be leased again (leased first: `admission.take_queued`)."""
        self.refusals: Counter[str] = Counter()

    def in_flight(self, ident: Identity, min_version: int) -> inflight.InFlight:
        proven = sum(n for v, n in self.flight[inflight.PROVEN].items() if v >= min_version)
        unproven = self.flight[inflight.UNPROVEN]
        usable = sum(n for v, n in unproven.items() if v >= min_version)
        return inflight.InFlight(ident.in_flight, proven, sum(unproven.values()), usable, self.by_source[ident.source],
                                 self.queued > 0)

    def usable_buffered(self, min_version: int) -> int:
        return sum(n for v, n in self.buffered.items() if v >= min_version)

    def grant(self, ident: Identity, max_prompts: int, version: int, now: float) -> Lease | str:
        """A lease for `ident`, or why none (`Leases._grant`'s order; see the module docstring)."""
        if version < 0:
            return WAIT_BACKPRESSURE
        adm = self.adm
        row = ident.row(now)
        min_version = version - self.k
        flight = self.in_flight(ident, min_version)
        record = self.source_record.setdefault(ident.source, [0, 0])
        allowed = min(admission.allowance(row, adm, (record[0], record[1])),
                      admission.identity_cap(adm, self.max_buffered))
        if flight.own >= allowed:
            self.refusals[REFUSED_ALLOWANCE] += 1
            return REFUSED_ALLOWANCE
        proven = admission.is_proven(row, adm)
        n = min(max_prompts, allowed - flight.own)
        if not proven:
            others = sum(1 for s in self.by_source if s != ident.source)
            part = admission.source_share(adm, self.cap, others + 1)
            n = min(n, part - flight.unproven_same_source, adm.max_unproven_prompts - flight.unproven)
        if n <= 0:
            self.refusals[WAIT_UNPROVEN] += 1
            return WAIT_UNPROVEN
        if self.max_buffered is not None and self.usable_buffered(min_version) + \
                admission.counted_in_flight(flight, self.cap) >= self.max_buffered:
            self.refusals[WAIT_BACKPRESSURE] += 1
            return WAIT_BACKPRESSURE
        counted = inflight.counted_as(proven, ident.source)
        self.flight[counted[0]][version] += n
        if counted[0] == inflight.UNPROVEN:
            self.by_source[ident.source] += n
        self.queued = max(0, self.queued - n)
        ident.prompts_leased += n
        record[0] += n
        ident.in_flight += n
        return Lease(ident, n, version, now + self.ttl, counted)

    def close(self, lease: Lease, unused: int, penalise: bool = True) -> bool:
        """Close `lease` (once): its prompts leave the counts, the `unused` ones are queued again and, with
        `penalise`, counted as abandoned by its identity (`admission.close_leases`). False if already closed."""
        if not lease.open:
            return False
        lease.open = False
        cls, source = lease.counted
        c = self.flight[cls]
        c[lease.version] -= lease.n
        if c[lease.version] <= 0:
            del c[lease.version]
        if cls == inflight.UNPROVEN:
            self.by_source[source] -= lease.n
            if self.by_source[source] <= 0:
                del self.by_source[source]
        lease.ident.in_flight -= lease.n
        if penalise:
            lease.ident.prompts_abandoned += unused
            self.source_record.setdefault(lease.ident.source, [0, 0])[1] += unused
        self.queued += unused
        return True

    def buffer(self, version: int, n: int) -> None:
        """`n` groups of `version` enter (n > 0) or leave (n < 0) what backpressure counts as buffered."""
        self.buffered[version] += n
        if self.buffered[version] <= 0:
            del self.buffered[version]

    def room(self, version: int) -> tuple[int, int]:
        """Prompts that could be leased now before backpressure (and before the unproven share) stops it."""
        min_version = version - self.k
        proven = sum(n for v, n in self.flight[inflight.PROVEN].items() if v >= min_version)
        unproven = self.flight[inflight.UNPROVEN]
        usable = sum(n for v, n in unproven.items() if v >= min_version)
        flight = inflight.InFlight(0, proven, sum(unproven.values()), usable, 0)
        total = self.max_buffered if self.max_buffered is not None else 1 << 30
        room = total - self.usable_buffered(min_version) - admission.counted_in_flight(flight, self.cap)
        return room, self.cap - flight.unproven
