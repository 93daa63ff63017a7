"""What an operator sees at a glance (GET /v1/overview, the dashboard): group outcomes and why groups were
rejected, node states, how far each checkpoint has spread among live nodes, and the ledger's totals.

Every list is bounded, so the answer stays small however large the pool."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from swarmrl.protocol.strict import Strict

MAX_REASONS = 20
MAX_SPREAD_VERSIONS = 32


class ReasonCount(Strict):
    reason: str = Field(description="A rejection reason with its numbers replaced by '#' (one line per kind).")
    groups: int
    example: str = Field(description="One reason of this kind, as the verifier wrote it.")


class VersionSpread(Strict):
    version: int = Field(description="A policy version nodes hold (-1: none yet).")
    nodes: int = Field(description="Live, unbanned nodes holding it as their newest.")


class Blocker(StrEnum):
    """Something that keeps the pool from training now (docs/liveness.md says what each one waits on)."""

    NO_CHECKPOINT = "no_checkpoint"
    """No policy version has been published yet: the trainer has not published its first checkpoint."""
    TRAINER_ABSENT = "trainer_absent"
    """The trainer has not read the feed for a while: it is stopped, or cannot reach the coordinator."""
    NO_NODES = "no_nodes"
    """No live node: nobody generates."""
    NO_VERIFIER = "no_verifier"
    """Groups wait for a verdict and no verifier has claimed any for a while."""
    BUFFER_FULL = "buffer_full"
    """Leases are withheld: max_buffered_groups are waiting for verdicts, for the trainer, or leased."""
    HELD_AWAITING_CHECKS = "held_awaiting_checks"
    """Groups passed the cheap checks and wait for a later drawn check of their nodes (docs/quarantine.md)."""
    WAITING_FOR_GROUPS = "waiting_for_groups"
    """Nothing is blocked: the nodes produce verified groups more slowly than the trainer takes them."""


BLOCKER_TEXT: dict[Blocker, str] = {
    Blocker.NO_CHECKPOINT: "no checkpoint published yet (is the trainer started?)",
    Blocker.TRAINER_ABSENT: "the trainer has not read the feed recently (start it, or check its log)",
    Blocker.NO_NODES: "no live node",
    Blocker.NO_VERIFIER: "groups wait for a verdict and no verifier is claiming them (start one, or check its log)",
    Blocker.BUFFER_FULL: "the buffer is full: leases wait until the verifier or the trainer takes groups",
    Blocker.HELD_AWAITING_CHECKS: "groups are held until their nodes' next drawn checks",
    Blocker.WAITING_FOR_GROUPS: "the trainer is waiting for enough verified groups",
}
"""One line per blocker, for people (the dashboard, the node's panel, the log)."""


class Training(Strict):
    """Whether training moves, and what blocks it now (the coordinator's watchdog)."""

    last_step_at: float | None = Field(description="When the newest policy version was published (None: none yet).")
    since_last_step_s: float = Field(description="Seconds since then (since the coordinator started, before any).")
    stalled: bool = Field(description="No new version for longer than the watchdog's stall_after_s.")
    blockers: list[Blocker] = Field(description="What keeps the pool from training now, most basic first; empty "
                                                "when nothing does.")
    why: str = Field(description="The blockers in words, one line ('' when there are none).")


class Overview(Strict):
    now: float = Field(description="The coordinator's clock, unix seconds (node liveness is judged against it).")
    current_version: int
    groups: dict[str, int] = Field(description="Groups by outcome: pending, held, accepted, rejected.")
    reasons: list[ReasonCount] = Field(max_length=MAX_REASONS, description="Rejection reasons, most frequent first.")
    nodes: dict[str, int] = Field(description="Nodes by state: live, gone (not heard from for gone_after_s), banned.")
    gone_after_s: float
    spread: list[VersionSpread] = Field(max_length=MAX_SPREAD_VERSIONS,
                                        description="Live, unbanned nodes per held version, newest version first.")
    ledger_groups: int = Field(description="Accepted groups in the ledger (every node, every version).")
    ledger_tokens: int
    receipts: int = Field(description="Receipts signed so far.")
    training: Training | None = Field(None, description="Whether training moves, and what blocks it.")
    pool_name: str = Field("", description="The name nodes join the pool by (the run id when it announces none).")
