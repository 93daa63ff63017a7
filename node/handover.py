"""The hand-off of verified checkpoints from a node's fetch thread to its generating thread.

Kept apart from `node.weights`, which feeds and empties it, so that the fetcher's question of which versions are in
use is answered here, below the code that called the fetcher."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from swarmrl.node.stats import NodeStats

__all__ = ["ReadyWeights"]


class ReadyWeights:
    """The newest verified checkpoint not yet loaded (`ready`), and the one being loaded. Thread-safe.

    A ready checkpoint may wait a while: one newer than the lease in hand is not loaded for it (the verifier bans a
    node that generates with weights newer than its lease), and the fetch thread goes on fetching meanwhile.
    `versions()` names both, and `in_use()` the one held as well (`stats.held_version`), so that the fetcher keeps
    their files on disk until they are loaded and while they are held."""

    def __init__(self, stats: NodeStats) -> None:
        self.stats = stats
        self._lock = threading.Lock()
        self.ready: tuple[int, Path] | None = None
        self._loading: int | None = None

    def offer(self, version: int, path: Path) -> None:
        """`version`, at `path`, is the newest fetched: it replaces any ready one."""
        with self._lock:
            self.ready = (version, path)

    def newer_than(self, version: int) -> bool:
        """Whether the ready checkpoint is newer than `version`."""
        with self._lock:
            return self.ready is not None and self.ready[0] > version

    def versions(self) -> set[int]:
        """The versions ready or being loaded."""
        with self._lock:
            return {v for v in (self._loading, self.ready and self.ready[0]) if v is not None}

    def in_use(self) -> set[int]:
        """The versions the fetcher keeps on disk whatever their age: held, being loaded, or ready."""
        return {self.stats.held_version, *self.versions()}

    @contextmanager
    def take(self, max_version: int | None = None) -> Iterator[tuple[int, Path] | None]:
        """The ready checkpoint, no longer ready but named by `versions()` until the block ends; None when there is
        none, or (with `max_version`) when it is newer than that (it stays ready then)."""
        with self._lock:
            ready = self.ready
            if ready is None or (max_version is not None and ready[0] > max_version):
                ready = None
            else:
                self.ready, self._loading = None, ready[0]
        try:
            yield ready
        finally:
            if ready is not None:
                with self._lock:
                    self._loading = None
