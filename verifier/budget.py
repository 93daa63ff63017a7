"""A per-identity budget of verifier time, so that no identity can buy unbounded verification.

Each identity has a token bucket of `budget_s` verifier seconds, refilled at budget_s / window_s per second; the
measured time of each of its full checks and of computing each of its groups' rewards (sandbox runs, answer
parsing; held groups too) is taken from it (it may go below zero: work is charged after it ran). Held groups are
charged one by one as they are scored, so an identity overspends by at most one group's rewards (each rollout's
bounded by the task's own caps, such as the code task's `rollout_sandbox_s`) plus the groups of one claimed batch
that were drawn for a full check, which are checked together.
While the bucket is empty, the identity is over budget and the verifier *defers* its groups: it leaves
them without a verdict, so the coordinator keeps them pending and hands them out again after its claim expires.

Why defer rather than refuse: the budget is about the verifier's time, not about the node's honesty. An honest
node in its warm-up (every group fully checked) or with a burst of work must not lose groups it generated in
good faith; a refused group cannot be resubmitted (its lease prompt is used). Deferring costs an attacker its
groups' freshness and nothing else, and gains it nothing: a group's draw is made once, at its first claim, and
a deferred group keeps it (see `protocol.quarantine`). What deferral does not stop
is many identities each within its budget; that needs admission of young identities at the coordinator.

Per identity, and per source: a group reaches the verifier with its node's id and the source (address) the node
registered from, as the coordinator saw it (`PendingGroup.node_source`, in the coordinator's signed answer), and
the verifier keeps a second bucket per source (`source_budget_s`), so the free identities of one machine share one
budget. Either bucket spent defers the group.

Memory: only identities whose bucket is not full are remembered, at most `max_identities` (the least recently
charged are forgotten, i.e. given a full bucket).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class IdentityBudget:
    def __init__(self, budget_s: float, window_s: float, clock: Callable[[], float] = time.monotonic,
                 max_identities: int = 100_000):
        if budget_s <= 0 or window_s <= 0:
            raise ValueError("budget_s and window_s must be positive")
        self.budget_s, self.rate = budget_s, budget_s / window_s
        self.clock = clock
        self.max_identities = max_identities
        self._level: OrderedDict[str, tuple[float, float]] = OrderedDict()
        """identity -> (bucket level in seconds, when it was last updated)."""

    def level(self, identity: str) -> float:
        """Seconds left in the identity's bucket now (negative: over budget)."""
        now = self.clock()
        if identity not in self._level:
            return self.budget_s
        level, at = self._level[identity]
        level = min(self.budget_s, level + (now - at) * self.rate)
        if level >= self.budget_s:
            del self._level[identity]
        else:
            self._level[identity] = (level, now)
        return level

    def over(self, identity: str) -> bool:
        """Whether the identity has spent its budget: its groups are to be deferred."""
        return self.level(identity) <= 0

    def charge(self, identity: str, seconds: float) -> None:
        """Take `seconds` of verifier time from the identity's bucket."""
        level = self.level(identity) - max(seconds, 0.0)
        self._level[identity] = (level, self.clock())
        self._level.move_to_end(identity)
        while len(self._level) > self.max_identities:
            self._level.popitem(last=False)
