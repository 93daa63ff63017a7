"""What a node counts about itself, for its live panel and its logs (never sent as facts: the coordinator keeps its
own books)."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def tokens_per_s(self) -> float:
        """Generation throughput: completion tokens per second spent generating."""
        return self.tokens / self.gen_seconds if self.gen_seconds else 0.0


@dataclass(frozen=True)
class Download:
    """A checkpoint being fetched: its version, shard count and size, and the fetcher's count of shards stored
    (fetched or reused) when it began, so that progress is that count's growth."""

    version: int
    shards: int
    bytes: int
    counter_at_start: int
