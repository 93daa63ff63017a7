"""The verifier's side of the quarantine rule (`protocol.quarantine`; docs/quarantine.md): the draws.

For each group the rule says warm-up, sampled, overflow or hold, from the node's passed checks and held groups
as the coordinator recorded them when the group was claimed (plus what this verifier decided earlier in the
same batch: those verdicts are posted together, so the record does not show them yet). The number drawn for
a group comes from the operating system's randomness unless a seed is given (tests), so a node cannot predict
it; and it is drawn only for a group that will get a verdict in this batch.
"""

from __future__ import annotations

import random

from swarmrl.protocol.quarantine import Check, Rules, decide


class CheckPolicy:
    """Draws the check of each group under `rules`."""

    def __init__(self, rules: Rules, seed: int | None = None):
        self.rules = rules
        self._rng: random.Random = random.SystemRandom() if seed is None else random.Random(seed)

    def decide(self, passes: int, held: int) -> Check:
        """The check of a node's next group, given its passed checks and the groups it holds now."""
        return decide(self.rules, passes, held, self._rng.random())
