"""Virtual time: a heap of (time, order, callback). Nothing waits for real time, nothing opens a socket.

Why our own and not SimPy: every actor here is a callback that runs at a time and schedules its next one, and the
policy code it calls takes `now` (or a clock callable) as an argument; SimPy's processes (generators resumed
through event objects) would add per-event overhead to the millions of events of a 10,000-node day on a shared
2-core machine, and a dependency, for nothing this model needs (no resources, no interrupts).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


class Clock:
    """The simulation's time: `now` in seconds from the start, advanced only by `run`."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._order = 0
        self.events = 0

    def __call__(self) -> float:
        """The clock callable the policy code takes (`IdentityBudget(clock=...)`)."""
        return self.now

    def at(self, when: float, fn: Callable[..., None], *args) -> None:
        """Run `fn(*args)` at virtual time `when` (now, if it is past); same-time events run in scheduling order."""
        self._order += 1
        heapq.heappush(self._heap, (when if when > self.now else self.now, self._order, fn, args))

    def after(self, delay: float, fn: Callable[..., None], *args) -> None:
        self.at(self.now + delay, fn, *args)

    def run(self, until: float, on_tick: Callable[[float], None] | None = None, tick_s: float = 60.0) -> None:
        """Run every event up to `until`; `on_tick(now)` once per `tick_s` of virtual time (progress, samples)."""
        heap, pop = self._heap, heapq.heappop
        next_tick = tick_s
        while heap and heap[0][0] <= until:
            when, _, fn, args = pop(heap)
            while on_tick is not None and when >= next_tick:
                self.now = next_tick
                on_tick(next_tick)
                next_tick += tick_s
            self.now = when
            self.events += 1
            fn(*args)
        while on_tick is not None and next_tick <= until:
            self.now = next_tick
            on_tick(next_tick)
            next_tick += tick_s
        self.now = until
