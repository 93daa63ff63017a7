"""Which groups get the full (prefill) check: every group of a node until it has passed K, then a rate p.

The coordinator enforces the other half (quarantine): a group that passed only the cheap checks is *held*,
and reaches the trainer only when a full check of a group the same node submitted later passes; a failed
check bans the node and drops everything it still has held or pending. So with p < 1 a cheating node can
have an unchecked group trained on only by also passing a later check, and every check it fails costs it all
of its unreleased work and its identity (a new identity starts again at K full checks).

Choices are drawn from the OS's randomness unless a seed is given (tests), so a node cannot predict them.
"""

from __future__ import annotations

import random


class CheckPolicy:
    """Decides per group "full check" or "cheap checks + hold"."""

    def __init__(self, warmup_checks: int, sample_rate: float, seed: int | None = None):
        if warmup_checks < 0 or not 0.0 <= sample_rate <= 1.0:
            raise ValueError("warmup_checks must be >= 0 and sample_rate in [0, 1]")
        self.warmup_checks = warmup_checks
        self.sample_rate = sample_rate
        self._rng: random.Random = random.SystemRandom() if seed is None else random.Random(seed)
        self._passed: dict[str, int] = {}

    def passed(self, node_id: str, on_record: int) -> int:
        """Full checks the node has passed: the coordinator's count, or ours if this process saw more."""
        return max(on_record, self._passed.get(node_id, 0))

    def wants_full_check(self, node_id: str, on_record: int) -> bool:
        """True: run the full check. False: cheap checks only, and the coordinator holds the group."""
        if self.passed(node_id, on_record) < self.warmup_checks:
            return True
        return self.sample_rate >= 1.0 or self._rng.random() < self.sample_rate

    def record_pass(self, node_id: str, on_record: int) -> None:
        self._passed[node_id] = self.passed(node_id, on_record) + 1
