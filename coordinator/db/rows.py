"""Typed rows: what the coordinator's queries return, one frozen dataclass per table (or per joined view).

Field names are column names (`coordinator.db.store.load` builds a row from a result row); JSON columns arrive
decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NodeRow:
    """A registered node: identity, liveness, verdict counters, ban state and its self-reported time counters."""

    id: str
    public_key: str
    name: str
    engine: str
    registered_at: float
    last_seen: float
    held_version: int
    banned: bool
    ban_reason: str
    groups_accepted: int
    groups_rejected: int
    reputation: float
    checks_passed: int
    idle_s: float
    """The node's last reported idle seconds since it started (untrusted, as reported)."""
    busy_s: float
    idle_total: float
    """Coordinator-side idle seconds summed over the node's reports (never decreases)."""
    busy_total: float
    counters_at: float | None
    """When the node last reported its counters; None before its first report."""
    prompts_leased: int
    """Prompts ever leased to the node."""
    prompts_abandoned: int
    """Of those, how many it left unused: not submitted by the lease's expiry, left out of its submission, or refused
    at submission (`coordinator.admission`)."""
    source: str
    """The address it last registered from (`coordinator.ratelimit.source_of`)."""
    gone_since: float | None = None
    """When the node was marked gone for missing its heartbeats; None while it is live."""
    in_flight: int = 0
    """Prompts of its open leases not submitted (`coordinator.inflight`)."""


@dataclass(frozen=True)
class LeaseRow:
    id: str
    node_id: str
    policy_version: int
    issued_at: float
    expires_at: float
    sampling: dict[str, Any]
    state: str
    """'open' until a submission settles it, it turns stale or it expires; then 'done'."""
    signature: dict[str, Any] | None
    """The coordinator's signature of the lease (`protocol.leases`); None for leases from before signed leases."""
    digests: list[str] | None
    """The digests of its prompts, in leased order, as signed."""


@dataclass(frozen=True)
class LeasePromptRow:
    lease_id: str
    prompt_id: str
    position: int
    text: str
    answer: str
    """The ground truth: never sent to a node."""
    seeds: list[int]
    submitted: bool


@dataclass(frozen=True)
class GroupRow:
    """A submitted rollout group and where it is in its life (see `coordinator.verification`)."""

    id: int
    node_id: str
    lease_id: str
    prompt_id: str
    policy_version: int
    payload: dict[str, Any]
    """The RolloutGroup as submitted (JSON)."""
    status: str
    """'pending', 'accepted' or 'rejected'."""
    reason: str
    rewards: list[float] | None
    """The verifier's trusted rewards, once it accepted the group (held or not)."""
    claimed_by: str | None
    claimed_until: float | None
    accepted_seq: int | None
    """The group's trainer-feed position, once accepted."""
    submitted_at: float
    decided_at: float | None
    held: bool
    vouches: int
    """Vouching full checks it has had while held (`protocol.quarantine`)."""


@dataclass(frozen=True)
class ClaimedGroup:
    """A pending group a verifier claimed, with the signed lease it is checked against."""

    id: int
    node_id: str
    policy_version: int
    payload: dict[str, Any]
    lease_id: str
    prompt_id: str
    prompt_text: str
    answer: str
    seeds: list[int]
    position: int
    lease_version: int
    expires_at: float
    sampling: dict[str, Any]
    signature: dict[str, Any] | None
    digests: list[str] | None
    node_checks_passed: int
    node_held: int
    """Groups of the node held when this one was claimed."""
    node_source: str
    """The source the node registered from."""
    node_key: str
    """The node's public key (the verifier checks the group's node signature against it)."""
    draw: float | None
    """The quarantine rule's number for this group, drawn at its first claim (None before it)."""
    draw_passes: int | None
    """The node's passed checks at the group's first claim."""
    draw_held: int | None
    """The node's held groups at the group's first claim."""


@dataclass(frozen=True)
class FeedRow:
    """An accepted group at its trainer-feed position."""

    accepted_seq: int
    policy_version: int
    payload: dict[str, Any]
    rewards: list[float]
    lease_id: str
    node_key: str
    """The submitting node's public key (the trainer checks the group's node signature against it)."""


@dataclass(frozen=True)
class MetricsRow:
    id: int
    step: int
    version: int
    data: dict[str, float]
    ts: float
    node_idle_total: float
    node_busy_total: float
