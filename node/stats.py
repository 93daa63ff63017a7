"""What a node counts about itself, for its live panel and its logs (never sent as facts: the coordinator keeps its
own books)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol

from swarmrl.protocol.messages import ALREADY_SUBMITTED, RolloutSubmission, SubmitResult
from swarmrl.protocol.overview import Training
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.runtime.client import CoordinatorError

log = logging.getLogger("swarmrl.node")

NO_WORK_ASK_EVERY_S = 10.0

# Refusals the whole submission got on a retry that may repeat an applied earlier try: outcome unknown.
_MAYBE_APPLIED = frozenset({RefusalCode.UNKNOWN_LEASE, RefusalCode.LEASE_EXPIRED, RefusalCode.REPLAYED,
                            RefusalCode.STALE_SUBMISSION})


class TrainingSource(Protocol):
    def training(self) -> Training: ...


@dataclass
class NodeStats:
    leases: int = 0
    groups_submitted: int = 0  # groups in submissions the coordinator answered
    groups_accepted: int = 0  # taken for verification
    groups_rejected: int = 0  # refused at submission (the latest reason: last_rejection)
    groups_unconfirmed: int = 0  # refused on a retry whose earlier try may have been applied: outcome unknown
    tokens: int = 0  # completion tokens generated
    accepted_tokens: int = 0  # completion tokens of the groups taken
    gen_seconds: float = 0.0
    idle_seconds: float = 0.0  # waiting for work, or for weights recent enough for a lease
    busy_seconds: float = 0.0  # generating and submitting
    held_version: int = -1
    current_version: int = -1  # the coordinator's newest version, as last seen
    registrations: int = 0
    untrusted: int = 0  # answers refused because they did not carry the coordinator's signature (e.g. a lease)
    receipts: int = 0  # valid receipts of this pool held in receipts.jsonl
    receipt_tokens: int = 0
    last_error: str = ""
    last_rejection: str = ""
    no_work: str = ""  # why the coordinator has no work for this node (its watchdog's words); "" while it has
    no_work_asked_at: float = -math.inf

    def count_lease(self) -> None:
        self.leases += 1
        self.no_work = ""

    def ask_why_no_work(self, client: TrainingSource, now: float) -> None:
        """The coordinator had no lease for this node: ask it why (GET /v1/training), at most every
        NO_WORK_ASK_EVERY_S (`now`: a monotonic clock). A failed question keeps the last answer."""
        if now - self.no_work_asked_at < NO_WORK_ASK_EVERY_S:
            return
        self.no_work_asked_at = now
        try:
            self.no_work = client.training().why or "none leased just now (the pool is not blocked)"
        except Exception as e:  # only words for the panel: never worth stopping for
            log.debug("could not ask why there is no work: %s", e)

    def outage_context(self, node_id: str) -> str:
        """What the node `node_id` keeps while the coordinator cannot be reached (for the outage's log line)."""
        if self.registrations:
            return f"keeping policy v{self.held_version} and identity {node_id[:10]}"
        # never joined: nothing is kept yet, and the URL may be wrong
        return "not joined yet: check coordinator_url if that coordinator is up (`swarmrl node doctor` tries it)"

    @property
    def tokens_per_s(self) -> float:
        """Generation throughput: completion tokens per second spent generating."""
        return self.tokens / self.gen_seconds if self.gen_seconds else 0.0

    def count_refused(self, submission: RolloutSubmission, e: CoordinatorError) -> None:
        """A refusal of the whole submission. On a retry of a request that may have reached the coordinator
        before (its answer lost), "unknown lease"/"lease expired"/a conflict may be about that applied try:
        those groups are counted as unconfirmed, not as rejected."""
        n = len(submission.groups)
        self.groups_submitted += n
        if e.retried and e.code in _MAYBE_APPLIED:
            self.groups_unconfirmed += n
            log.warning("submission of lease %s: outcome unknown (an earlier try may have been applied before the "
                        "answer was lost): %s", submission.lease_id, e.reason)
            return
        self.groups_rejected += n
        self.last_rejection = self.last_error = e.reason
        log.warning("submission refused: %s", e.reason)

    def count_result(self, submission: RolloutSubmission, result: SubmitResult) -> None:
        """The coordinator's answer to a submission: groups taken and refused (with the latest reason).

        A retried submit whose first try was applied (its answer lost) gets "already submitted" for the groups
        that try delivered: those were taken, not refused. (A coordinator that honours the Idempotency-Key
        header answers the first result again instead.)"""
        taken = set(result.accepted) | {pid for pid, r in result.rejected.items() if r == ALREADY_SUBMITTED}
        refused = {pid: r for pid, r in result.rejected.items() if pid not in taken}
        tokens = {g.prompt_id: sum(len(r.completion_ids) for r in g.rollouts) for g in submission.groups}
        self.groups_submitted += len(submission.groups)
        self.groups_accepted += len(taken)
        self.accepted_tokens += sum(tokens.get(pid, 0) for pid in taken)
        self.groups_rejected += len(refused)
        for pid, reason in refused.items():
            self.last_rejection = f"{pid}: {reason}"
            log.warning("group %s refused: %s", pid, reason)


@dataclass(frozen=True)
class Download:
    """A checkpoint being fetched: its version, shard count and size, and the fetcher's count of shards stored
    (fetched or reused) when it began, so that progress is that count's growth."""

    version: int
    shards: int
    bytes: int
    counter_at_start: int
