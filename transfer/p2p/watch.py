"""Watch streams: what holders of a version store, heard of at once instead of through their DHT records.

For every version it looks up, a swarm peer opens a watch (`OP_WATCH`, see wire.py) to up to `watch_peers`
holders and follows their HAVE messages (`Watches.follow`); `Watches.merge` adds what they reported to their
DHT records, which lag seconds behind under load. A watcher closes its stream once the holder holds
everything (there is no more news; the holder closes only after it). Only the newest `LIVE_VERSIONS` versions
are followed. Thread-safe; the streams run on the owner's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from swarmrl.protocol.manifest import CheckpointManifest
from swarmrl.transfer.p2p.client import ShardClient
from swarmrl.transfer.p2p.config import P2PConfig
from swarmrl.transfer.p2p.dht import HolderRecord, bitfield_indices, make_bitfield, manifest_info
from swarmrl.transfer.p2p.wire import HAVE_BYTES, OK, OP_WATCH, PeerError, SwarmStats, read_length, send_request

log = logging.getLogger(__name__)

WATCH_RETRY_S = 5.0  # a watch that failed is tried again after this long
LIVE_VERSIONS = 4  # checkpoint versions whose watches are kept (the newest)


@dataclass
class _Live:
    """What a watched peer reported holding, and its DHT record merged with that (kept until either changes)."""

    held: set[int]
    merged_from: HolderRecord | None = None  # the DHT record `merged` was made from
    merged_size: int = 0  # len(held) when it was made (held only grows)
    merged: HolderRecord | None = None


class Watches:
    """The watch streams of one swarm peer (`banned`: peers never watched, shared with the peer's health)."""

    def __init__(self, config: P2PConfig, stats: SwarmStats, client: ShardClient, banned: set[str]):
        self.config = config
        self.stats = stats
        self.client = client
        self.banned = banned
        self._live: dict[str, dict[str, _Live]] = {}  # manifest tag -> peer id -> what its watch reported
        # (tag, peer id) -> when a new watch may be opened: never while one is open or after the peer ended it
        # (it holds everything, or dropped the version); a while after a failure.
        self._watching: dict[tuple[str, str], float] = {}
        self.tasks: set[asyncio.Task[None]] = set()  # the open watches
        self._lock = threading.Lock()

    def watched(self, tag: str) -> set[str]:
        """Peers whose watch for version `tag` has reported its holdings (and is still followed)."""
        with self._lock:
            return set(self._live.get(tag, {}))

    def follow(self, manifest: CheckpointManifest, records: Mapping[str, HolderRecord]) -> None:
        """Open watches to holders in `records` not watched yet (up to `watch_peers`). Call on the event loop."""
        tag = manifest_info(manifest).tag
        with self._lock:
            if tag not in self._live:
                self._live[tag] = {}
                while len(self._live) > LIVE_VERSIONS:  # forget the oldest version's watches
                    old = next(iter(self._live))
                    del self._live[old]
                    self._watching = {k: v for k, v in self._watching.items() if k[0] != old}
            now = time.monotonic()
            new = [p for p in records if self._watching.get((tag, p), 0.0) <= now and p not in self.banned]
            room = self.config.watch_peers - sum(1 for (t, _), at in self._watching.items() if t == tag and at > now)
            new = new[: max(0, room)]
            self._watching.update(((tag, p), float("inf")) for p in new)
        for pid in new:
            task = asyncio.create_task(self._watch(pid, manifest))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def merge(self, tag: str, records: dict[str, HolderRecord]) -> None:
        """Replace, in `records`, each watched peer's DHT record by one that also has what it reported since."""
        with self._lock:
            for p, live in self._live.get(tag, {}).items():
                r = records.get(p)
                if r is None:
                    continue
                if live.merged_from is not r or live.merged_size != len(live.held):  # merged once per change
                    held = r.indices()
                    live.merged = r if live.held <= held else replace(
                        r, bits=make_bitfield(r.n_shards, held | live.held))
                    live.merged_from, live.merged_size = r, len(live.held)
                records[p] = live.merged  # type: ignore[assignment]

    def forget(self, tag: str) -> None:
        """Stop following version `tag` (retired): its watches' reports are dropped."""
        with self._lock:
            self._live.pop(tag, None)
            self._watching = {k: v for k, v in self._watching.items() if k[0] != tag}

    async def _watch(self, peer_id: str, manifest: CheckpointManifest) -> None:
        """Follow what `peer_id` holds of `manifest` over a watch stream, into `_live`."""
        info = manifest_info(manifest)
        tag, n = info.tag, len(info.shards)
        try:
            reader, writer = await self.client.open(peer_id)
            try:
                await send_request(writer, OP_WATCH, tag.encode())
                status = await asyncio.wait_for(reader.readexactly(1), self.config.peer_timeout_s)
                if status != OK:
                    raise PeerError(f"watch refused ({status!r})")
                size = await read_length(reader)
                if size != (n + 7) // 8:
                    return  # nonsense: not watched again (its DHT record still counts)
                held = set(bitfield_indices(await reader.readexactly(size), n))
                with self._lock:
                    live = self._live.get(tag)
                    if live is None:  # a version no longer followed
                        return
                    live[peer_id] = _Live(held)
                while len(held) < n:  # once the peer holds everything there is no more news: close (the
                    # peer closes its side only after this one, see ShardServer.handle)
                    i = int.from_bytes(await reader.readexactly(HAVE_BYTES), "big")
                    if i >= n:  # nonsense: stop listening to this peer (its DHT record still counts)
                        return
                    with self._lock:
                        self.stats.haves += 1
                        held.add(i)
            finally:
                writer.close()
        except asyncio.IncompleteReadError:
            pass  # the peer ended it: it holds every shard, or no longer serves this version
        except (PeerError, ConnectionError, TimeoutError, OSError) as e:
            log.debug("watch of %s failed: %s", peer_id[-8:], e)
            with self._lock:
                self._watching[(tag, peer_id)] = time.monotonic() + WATCH_RETRY_S
                self._live.get(tag, {}).pop(peer_id, None)  # no longer watched: the DHT speaks for it again
