"""A coordinator's pool announcement: a thread that keeps its signed pool record fresh in the DHT.

Every `ttl_s / 3` (sooner after a failed store) it builds a new record from `fields()` (the pool's current
version, nodes, accepted tokens...), signs it with the coordinator's key with a larger sequence number than the
last, and stores it under `POOLS_KEY`, subkey = the coordinator's public key, expiring when the record does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from swarmrl.pools.records import POOLS_KEY, record_value
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pools import PoolRecord, SignedPoolRecord
from swarmrl.transfer.p2p.host import DhtHost

log = logging.getLogger("swarmrl.pools")

RETRY_S = 5.0  # a failed store is tried again this soon (at most ttl / 3)


class PoolAnnouncer:
    """Announces one pool while it runs. `fields()` returns the PoolRecord fields other than the key, the
    lifetime and the sequence number; `announce_now()` stores one record at once (also used by tests)."""

    def __init__(self, host: DhtHost, identity: Identity, fields: Callable[[], dict[str, Any]], ttl_s: float = 60.0,
                 clock: Callable[[], float] = time.time):
        self.host = host
        self.identity = identity
        self.fields = fields
        self.ttl_s = ttl_s
        self.clock = clock
        self.seq = 0
        self.announced = 0
        self.last: SignedPoolRecord | None = None
        self.last_error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def bootstrap_addresses(self) -> list[str]:
        """This peer's multiaddrs others can dial (wildcard listen addresses left out): what an operator publishes."""
        return [a for a in self.host.maddrs if "/ip4/0.0.0.0/" not in a and "/ip6/::/" not in a]

    def make_record(self) -> SignedPoolRecord:
        now = self.clock()
        self.seq = max(self.seq + 1, int(now * 1000))
        record = PoolRecord(**self.fields(), coordinator_key=self.identity.public_key_hex, issued_at=now,
                            expires_at=now + self.ttl_s, seq=self.seq)
        return SignedPoolRecord.sign(record, self.identity)

    def announce_now(self, timeout: float = 30.0) -> bool:
        """Sign and store a fresh record; True when at least one DHT peer (this one included) stored it."""
        assert self.host.dht is not None
        signed = self.make_record()
        ok = bool(self.host.call(self.host.dht.store(POOLS_KEY, record_value(signed), signed.record.expires_at,
                                                     subkey=self.identity.public_key_hex), timeout))
        if ok:
            self.last, self.announced = signed, self.announced + 1
        return ok

    def _loop(self) -> None:
        while not self._stop.is_set():
            wait = self.ttl_s / 3
            try:
                if not self.announce_now():
                    raise RuntimeError("no DHT peer stored the record")
                if self.last_error:
                    log.info("pool record announced again")
                self.last_error = ""
            except Exception as e:  # noqa: BLE001 (keep announcing: the DHT may come back)
                if not self.last_error:
                    log.warning("announcing the pool in the DHT failed (%s: %s); retrying", type(e).__name__, e)
                self.last_error = f"{type(e).__name__}: {e}"
                wait = min(RETRY_S, wait)
            self._stop.wait(wait)

    def start(self) -> PoolAnnouncer:
        self._thread = threading.Thread(target=self._loop, name="pool-announcer", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop announcing and leave the DHT (the last record expires on its own within ttl_s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(35)
        self.host.close()
