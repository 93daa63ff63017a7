"""How many prompts a node asks for: as many as it generates in a share of a lease's time to live.

A lease's groups are due before it expires (the coordinator's `lease_ttl_s`); what is not submitted by then is
leased again to others, counted against this node. A fixed `max_prompts` is wrong at both ends: a laptop that
needs a minute per prompt lets whole leases expire (and holds back the version their prompts were leased for), and
a GPU that needs a second per prompt asks twice as often as it has to. The node measures what a prompt costs it
(the seconds its engine spent on each lease's groups, over the prompts in it: a moving average, so that a change of
model, load or version shows within a few leases) and asks for what fits `SHARE` of the time to live it saw on its
last lease, at least 1 and at most `max_prompts`. The share leaves room for the lease in hand to wait while the one
before it is generated (the pipelined node asks one lease ahead), for a submission's round trip, and for a slower
lease than the average.

Until it has measured a lease, a node asks for `max_prompts`. The coordinator caps every ask at the node's
allowance (`coordinator.admission`) whatever it asks for; the size only keeps an honest node's leases from expiring.
"""

from __future__ import annotations

import math

SHARE = 1 / 3
"""Of a lease's time to live, what its generation may take on average."""
SMOOTHING = 0.3
"""Weight of the newest lease in the moving average of seconds per prompt."""


class LeaseSizer:
    """The next lease's size for a node that may ask for up to `max_prompts`."""

    def __init__(self, max_prompts: int):
        self.max_prompts = max_prompts
        self.seconds_per_prompt: float | None = None
        """Moving average of the engine's seconds per prompt (None: nothing measured yet)."""
        self.ttl_s: float | None = None
        """The last lease's time to live as the node saw it on arrival (seconds to its expiry)."""

    def saw_lease(self, ttl_s: float) -> None:
        """A lease arrived with `ttl_s` seconds to go (measured on arrival: the coordinator's time to live, less the
        answer's trip)."""
        if ttl_s > 0:
            self.ttl_s = ttl_s

    def observe(self, prompts: int, seconds: float) -> None:
        """The engine spent `seconds` on a lease of `prompts` prompts."""
        if prompts <= 0 or seconds <= 0:
            return
        per = seconds / prompts
        self.seconds_per_prompt = per if self.seconds_per_prompt is None else \
            SMOOTHING * per + (1 - SMOOTHING) * self.seconds_per_prompt

    def ask(self) -> int:
        """Prompts to ask for in the next lease: `max_prompts` until a lease was measured, then what fits SHARE of
        the time to live, between 1 and `max_prompts`."""
        if self.seconds_per_prompt is None or self.ttl_s is None:
            return self.max_prompts
        fits = math.floor(SHARE * self.ttl_s / self.seconds_per_prompt)
        return max(1, min(self.max_prompts, fits))
