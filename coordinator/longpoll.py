"""Long polls: an operator's request that finds nothing waits for the store to change, up to `wait_s`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from swarmrl.coordinator.db.store import Store

T = TypeVar("T")


class LongPolls:
    """At most `max_slots` requests wait at once; the others are answered at once."""

    def __init__(self, store: Store, max_slots: int):
        self.store = store
        self._slots = threading.BoundedSemaphore(max_slots) if max_slots else None

    def wait(self, fetch: Callable[[], list[T]], wait_s: float) -> list[T]:
        """`fetch()` now; while it is empty, again after each change of the store, until `wait_s` has passed.

        The store's change generation is read before each fetch, so a change between the fetch and the wait is
        never missed; changes committed by other coordinator processes on the same PostgreSQL database count
        too. Only operator roles (verifiers, the trainer) long-poll: each wait holds one of the server's worker
        threads, so nodes, which may be thousands, never do.
        """
        slots = self._slots
        if wait_s <= 0 or slots is None or not slots.acquire(blocking=False):
            return fetch()
        try:
            deadline = time.monotonic() + wait_s
            while True:
                seen = self.store.generation
                rows = fetch()
                remaining = deadline - time.monotonic()
                if rows or remaining <= 0:
                    return rows
                self.store.wait_for_change(seen, remaining)
        finally:
            slots.release()
