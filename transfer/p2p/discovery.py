"""Discovery through the DHT: announcing what this peer holds, and reading who holds what.

- `Announcer` stores, per served version, an owner-signed holder record (see dht.py), refreshed every third of
  `record_ttl_s`: the first at once (empty while nothing is held yet), then new shards at most every
  `announce_interval_s` (`store_delay` decides), so a peer storing shards quickly costs the DHT one signed store
  (verified by every replica) per interval rather than one per shard; watchers hear of every shard at once.
- `HolderDirectory` reads the records of a version (`holders`), caches them for `poll_interval_s` (longer while
  the DHT shows no new peer and every known holder is watched: `next_poll`), opens watches to the holders
  (`watch.Watches`) and merges what those report into the records.

Both run on the owner's event loop; `holders` and `Announcer.poke` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.utils.timed_storage import get_dht_time

from swarmrl.protocol.manifest import CheckpointManifest
from swarmrl.transfer.p2p.client import ShardClient
from swarmrl.transfer.p2p.config import P2PConfig
from swarmrl.transfer.p2p.dht import (
    MAX_ADDRS,
    CachingSignatureValidator,
    HolderRecord,
    holders_key,
    make_bitfield,
    manifest_tag,
    parse_holders,
)
from swarmrl.transfer.p2p.serving import ShardServer
from swarmrl.transfer.p2p.watch import Watches
from swarmrl.transfer.p2p.wire import SwarmStats

log = logging.getLogger(__name__)


# -- announcing ------------------------------------------------------------------------------------------------


def store_delay(bits: bytes, announced: bytes | None, announced_at: float, now: float, interval: float,
                refresh: float) -> float:
    """Seconds until a version's record (holdings `bits`; `announced` at `announced_at`, None if never) should be
    stored again; 0: now. A first record and an emptied one go out at once; a change waits until `interval`
    after the previous store; an unchanged record is stored again every `refresh`."""
    fresh = now - announced_at < refresh
    if bits == announced and fresh:
        return announced_at + refresh - now
    due = announced_at + interval
    empty = not any(bits)
    if announced is not None and not empty and now < due and fresh:
        return due - now
    return 0.0


class Announcer:
    """Keeps this peer's holder records in the DHT for every version `server` serves."""

    def __init__(self, config: P2PConfig, run_id: str, stats: SwarmStats, server: ShardServer):
        self.config = config
        self.run_id = run_id
        self.stats = stats
        self.server = server
        self._dht: DHTNode | None = None
        self._rsa: CachingSignatureValidator | None = None
        self._peer_id = ""
        self._addrs: tuple[str, ...] = ()  # the addresses records carry (dialled by peers not yet connected)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def start(self, dht: DHTNode, rsa: CachingSignatureValidator, peer_id: str,
              maddrs: list[str]) -> asyncio.Task[None]:
        """Begin announcing (call on the event loop); returns the task, which the owner cancels."""
        self._dht, self._rsa = dht, rsa
        self._peer_id, self._addrs = peer_id, tuple(maddrs[:MAX_ADDRS])
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        return asyncio.create_task(self._run())

    def poke(self) -> None:
        """Holdings changed: announce soon (within `announce_delay_s`, batched). From any thread."""
        if self._loop is not None and self._event is not None:
            self._loop.call_soon_threadsafe(self._event.set)

    async def _run(self) -> None:
        assert self._event is not None
        refresh = self.config.record_ttl_s / 3
        wake = refresh
        while True:
            try:
                await asyncio.wait_for(self._event.wait(), timeout=wake)
                await asyncio.sleep(self.config.announce_delay_s)
            except TimeoutError:
                pass
            self._event.clear()
            wake = refresh
            try:
                wake = await self.announce_all()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 (try again at the next refresh)
                log.warning("announcing held shards failed: %s", e)

    async def announce_all(self) -> float:
        """Store a fresh record for every served version that `store_delay` says is due; forget versions that
        are retired, pruned from disk, or never got a shard before a newer version came. Returns the seconds
        until the next store is due, if nothing else happens."""
        assert self._dht is not None and self._rsa is not None
        now = time.monotonic()
        refresh = self.config.record_ttl_s / 3
        wake = refresh
        server = self.server
        with server.lock:
            served = list(server.served.items())
        newest = max((v.manifest.version for _, v in served), default=0)
        for tag, s in served:
            if now - s.announced_at > refresh and not s.retired:  # also notices shards pruned from disk
                held = await asyncio.get_running_loop().run_in_executor(
                    None, lambda s=s: {i for sha, idx in s.index.items() if s.store.has(sha) for i in idx})
                with server.lock:
                    if not s.retired:
                        s.held = held
            with server.lock:
                bits = make_bitfield(s.n_shards, s.held)
                empty = not s.held
                s.ever_held = s.ever_held or not empty
                gone = empty and (s.retired or s.ever_held or s.manifest.version < newest)
            if gone and s.announced is None:
                with server.lock:
                    server.served.pop(tag, None)
                continue
            delay = store_delay(bits, s.announced, s.announced_at, now, self.config.announce_interval_s, refresh)
            if delay > 0:
                wake = min(wake, delay)
                continue
            rec = HolderRecord(peer_id=self._peer_id, tag=tag, n_shards=s.n_shards, bits=bits, seed=self.config.seed,
                               addrs=self._addrs)
            ok = await self._dht.store(holders_key(self.run_id, s.manifest.version), rec.to_value(),
                                       get_dht_time() + self.config.record_ttl_s, subkey=self._rsa.local_public_key)
            if not ok:
                log.debug("DHT refused or lost the holder record for v%d", s.manifest.version)
            s.announced, s.announced_at = bits, now
            self.stats.announces += 1
            if gone:
                with server.lock:
                    server.served.pop(tag, None)
        return max(0.01, wake)


# -- reading who holds what --------------------------------------------------------------------------------------


@dataclass
class _Holders:
    records: dict[str, HolderRecord]
    at: float
    every: float  # re-read the DHT after this many seconds (see next_poll)
    refreshing: bool = False


def next_poll(previous: _Holders | None, records: Mapping[str, HolderRecord], watched: AbstractSet[str],
              poll: float) -> float:
    """Seconds until a version's holders are read from the DHT again, after a read that found `records`.

    Nothing new and every holder watched: the DHT can only tell of peers that join later, so it is read less
    often (the interval doubles, up to 8 poll intervals); any new peer brings the pace back to `poll`."""
    quiet = previous is not None and records.keys() <= previous.records.keys() and all(p in watched for p in records)
    return min(previous.every * 2, poll * 8) if quiet and previous is not None else poll


class HolderDirectory:
    """Who holds what of each version, per the DHT and the watch streams (this peer and banned peers excluded).

    `call(coro, timeout)` runs a coroutine on the owner's loop and waits for it; `submit(coro)` starts one there.
    """

    def __init__(self, config: P2PConfig, run_id: str, stats: SwarmStats, banned: set[str], watches: Watches,
                 client: ShardClient, call: Callable[[Coroutine[Any, Any, Any], float | None], Any],
                 submit: Callable[[Coroutine[Any, Any, Any]], object]):
        self.config = config
        self.run_id = run_id
        self.stats = stats
        self.banned = banned
        self.watches = watches
        self.client = client
        self._call, self._submit = call, submit
        self._dht: DHTNode | None = None
        self.peer_id = ""
        self._cache: dict[str, _Holders] = {}
        self._lock = threading.Lock()

    def attach(self, dht: DHTNode, peer_id: str) -> None:
        self._dht, self.peer_id = dht, peer_id

    def holders(self, manifest: CheckpointManifest, wait: bool = False) -> dict[str, HolderRecord]:
        """Peer id -> what it holds of `manifest`. A stale cache is refreshed in the background, a missing one
        synchronously (or whenever `wait`)."""
        tag = manifest_tag(manifest)
        with self._lock:
            c = self._cache.get(tag)
            stale = c is None or time.monotonic() - c.at > c.every
            start = stale and (c is None or not c.refreshing)
            if c is not None and start:
                c.refreshing = True
        if c is None or wait:
            try:
                self._call(self.refresh(manifest), self.config.dht_wait_timeout_s * 3)
            except Exception as e:  # noqa: BLE001 (no holders known: the seeds remain)
                log.debug("holder lookup failed: %s", e)
        elif start:
            self._submit(self.refresh(manifest))
        with self._lock:
            c = self._cache.get(tag)
            recs = dict(c.records) if c is not None else {}
        self.watches.merge(tag, recs)  # what watched peers reported since their records
        return {p: r for p, r in recs.items() if p not in self.banned}

    def interval(self, manifest: CheckpointManifest) -> float | None:
        """Seconds between DHT reads of `manifest`'s holders now (None: never read)."""
        with self._lock:
            c = self._cache.get(manifest_tag(manifest))
            return None if c is None else c.every

    async def refresh(self, manifest: CheckpointManifest) -> None:
        """Read `manifest`'s holder records from the DHT now, and follow the holders' watch streams."""
        assert self._dht is not None
        tag = manifest_tag(manifest)
        self.stats.dht_reads += 1
        try:
            raw = await self._dht.get(holders_key(self.run_id, manifest.version), latest=True)
            recs = parse_holders(raw, manifest)
            recs.pop(self.peer_id, None)
        except Exception:
            with self._lock:  # keep what was known; retry after poll_interval_s, never block on it again
                c = self._cache.get(tag)
                self._cache[tag] = _Holders(c.records if c is not None else {}, time.monotonic(),
                                            self.config.poll_interval_s)
            raise
        watched = self.watches.watched(tag)
        with self._lock:
            every = next_poll(self._cache.get(tag), recs, watched, self.config.poll_interval_s)
            self._cache[tag] = _Holders(recs, time.monotonic(), every)
        self.client.remember({pid: r.addrs for pid, r in recs.items()})
        self.watches.follow(manifest, recs)
