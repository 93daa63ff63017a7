"""The verifier's side of the quarantine rule (`protocol.quarantine`; docs/quarantine.md): the draws.

For each group the rule says warm-up, sampled, overflow or hold, from the node's passed checks and held groups
as the coordinator recorded them when the group was first claimed (plus what this verifier decided earlier in
the same batch: those verdicts are posted together, so the record does not show them yet). In the swarm the
number drawn for a group is the coordinator's, made at its first claim and kept by every re-claim
(`PendingGroup.draw`), so no verifier draws a group again; the simulator has this policy draw it, from the
operating system's randomness unless a seed is given.
"""

from __future__ import annotations

import random

from swarmrl.protocol.quarantine import Check, Rules, decide


class CheckPolicy:
    """Draws the check of each group under `rules`."""

    def __init__(self, rules: Rules, seed: int | None = None):
        self.rules = rules
        self._rng: random.Random = random.SystemRandom() if seed is None else random.Random(seed)

    def decide(self, passes: int, held: int, draw: float | None = None) -> Check:
        """The check of a node's next group, given its passed checks, the groups it holds now and the group's
        drawn number (drawn here when None)."""
        return decide(self.rules, passes, held, self._rng.random() if draw is None else draw)
