"""Which peers a swarm peer still deals with: the ban list and the drop list.

A peer that served bad bytes is banned for the rest of the process: never asked again, and refused service.
A peer that failed or was too slow `max_peer_failures` times in a row is dropped: left alone for `drop_s`.
Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time

from swarmrl.transfer.p2p.config import P2PConfig
from swarmrl.transfer.p2p.wire import SwarmStats

log = logging.getLogger(__name__)


class PeerHealth:
    def __init__(self, config: P2PConfig, stats: SwarmStats):
        self.config = config
        self.stats = stats
        self.banned: set[str] = set()  # read without the lock (a set's membership test is atomic)
        self._strikes: dict[str, int] = {}
        self._dropped_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def usable(self, peer_id: str) -> bool:
        """Neither banned nor currently dropped."""
        if peer_id in self.banned:
            return False
        with self._lock:
            return self._dropped_until.get(peer_id, 0.0) <= time.monotonic()

    def ban(self, peer_id: str, reason: str = "") -> None:
        """Never ask `peer_id` again and refuse its requests, for the rest of this process."""
        if peer_id not in self.banned:
            log.warning("banning peer %s: %s", peer_id, reason or "served bad bytes")
        self.banned.add(peer_id)

    def strike(self, peer_id: str) -> None:
        """One more failure of `peer_id`; enough in a row and it is dropped for `drop_s`."""
        with self._lock:
            n = self._strikes.get(peer_id, 0) + 1
            self._strikes[peer_id] = n
            self.stats.peer_failures += 1
            if n >= self.config.max_peer_failures:
                self._strikes[peer_id] = 0
                self._dropped_until[peer_id] = time.monotonic() + self.config.drop_s
                log.info("dropping peer %s for %.0f s after %d failures", peer_id[-8:], self.config.drop_s, n)

    def forgive(self, peer_id: str) -> None:
        """`peer_id` delivered: its run of failures is over."""
        with self._lock:
            self._strikes.pop(peer_id, None)
