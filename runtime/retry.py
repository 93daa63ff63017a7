"""Waiting out a coordinator that cannot be reached: the retry policy, its backoff, and outage bookkeeping.

`RetryPolicy` says which failures are worth another try and how long to wait before it: exponential backoff
with full jitter (a uniform draw between 0 and min(cap, base * 2^attempt)), so that thousands of nodes that lost
the coordinator at the same moment do not all come back at the same moment. `Outage` is shared by every thread
that talks to one coordinator: the first failure of an outage is logged once, and so is its end, with how long it
lasted, however many tries each thread made in between.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("swarmrl.client")

# 502/503/504: a proxy in front of a coordinator that is down or restarting, or the coordinator shedding load; 507:
# its disk is full (nothing was stored, and its operator is told): waited out like an outage, the work kept.
UNAVAILABLE_STATUSES = frozenset({502, 503, 504, 507})
# An internal error may be this request's own (the same request fails every time): retried a few times only.
INTERNAL_ERROR_RETRIES = 2


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries transport errors and 5xx answers.

    `attempts`: retries after the first try; None retries for as long as it takes (a node's main loop), unless
    `give_up_after_s` (seconds since the first try) runs out first.
    """

    attempts: int | None = 5
    base_s: float = 0.2
    cap_s: float = 30.0
    give_up_after_s: float | None = None

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Full jitter: uniform in [0, min(cap_s, base_s * 2^attempt)]."""
        bound = min(self.cap_s, self.base_s * (2 ** min(attempt, 30)))
        return (rng or random).uniform(0.0, bound)

    def may_retry(self, attempt: int, started: float, now: float) -> bool:
        """Whether retry number `attempt` (0 for the first retry) is allowed, the first try having been at `started`."""
        if self.attempts is not None and attempt >= self.attempts:
            return False
        return self.give_up_after_s is None or now - started < self.give_up_after_s


@dataclass
class Outage:
    """Whether the coordinator at `url` is reachable, as the requests of every thread sharing it see it.

    `failed` and `ok` are called after each try; only transitions are logged: one warning when an outage starts
    (with `context()`, e.g. what the node keeps meanwhile) and one line when it ends, with its length. `quiet`:
    nothing is logged (a caller waiting for a coordinator it has just started expects it to be down a while).
    """

    url: str
    context: Callable[[], str] = lambda: ""
    quiet: bool = False
    down_since: float | None = None  # time.monotonic() of the outage's first failure; None while reachable
    last_error: str = ""
    tries: int = 0  # failed tries during the current outage
    outages: int = 0  # outages so far
    longest_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def failed(self, error: str) -> None:
        with self._lock:
            self.last_error = error
            self.tries += 1
            if self.down_since is not None:
                return
            self.down_since = time.monotonic()
            self.outages += 1
        if self.quiet:
            return
        extra = self.context()
        log.warning("coordinator %s unreachable (%s); waiting it out with backoff%s", self.url, error,
                    f", {extra}" if extra else "")

    def ok(self) -> None:
        if self.down_since is None:  # the common case, without the lock
            return
        with self._lock:
            if self.down_since is None:
                return
            lasted = time.monotonic() - self.down_since
            tries, self.down_since, self.tries = self.tries, None, 0
            self.longest_s = max(self.longest_s, lasted)
        if not self.quiet:
            log.warning("coordinator %s reachable again after %.1f s (%d failed tries)", self.url, lasted, tries)

    @property
    def down_for_s(self) -> float | None:
        """Seconds since the current outage began, or None while the coordinator is reachable."""
        since = self.down_since
        return None if since is None else time.monotonic() - since
