"""The serving half of a swarm peer: the versions it serves, its uploads, its watch streams, a seed's hints.

`SwarmPeer` (swarm.py) owns one `ShardServer` and registers `ShardServer.handle` for stream `PROTOCOL`.

Wire protocol on stream `/swarmrl/shard/1`, one request per stream: an op byte, an 8-byte big-endian
length, the payload.

- `G` + sha256 hex: the response is a status byte (0 ok, 1 not held, 2 refused, 4 busy: all upload slots
  taken, ask again shortly) and, when ok, an 8-byte length and the shard bytes.
- `S` + manifest tag + bitfield of wanted shards: a status byte and, when ok, the 8-byte index of the shard
  the peer would rather send (seeds spread their uploads this way); status 3 means "none of these now: they
  are on their way to other peers, take them from those".
- `W` + manifest tag: a watch. The status byte, then (when ok) an 8-byte length and the peer's bitfield of
  held shards, then a 4-byte index for every shard it stores from then on (BitTorrent's HAVE messages); the
  peer ends the stream once it holds every shard or stops serving the version. Watches carry fresh
  holdings: under load a DHT store took 2 s and a DHT read 1 s, so a new copy showed up in the DHT about 4 s
  after it was stored.

Uploads pass through one token bucket (`upload_cap_mbps`); at most `max_uploads` run at once and
`upload_queue` more wait, further requests are answered busy (a seed runs `seed_max_uploads` at once and
queues everyone else). One peer's requests are served one at a time in one slot: a request from a peer that
already has an upload here waits behind it (pipelining; at most MAX_PIPELINED) and never counts as busy.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hivemind.p2p import P2P

from swarmrl.protocol.manifest import CheckpointManifest, ShardRef
from swarmrl.transfer.p2p.config import P2PConfig
from swarmrl.transfer.p2p.dht import bitfield_indices, make_bitfield, manifest_info, manifest_tag
from swarmrl.transfer.store import ShardStore

if TYPE_CHECKING:
    from swarmrl.transfer.p2p.swarm import SwarmStats

log = logging.getLogger(__name__)

PROTOCOL = "/swarmrl/shard/1"
OK, NOT_HELD, REFUSED, LATER, BUSY = b"\x00", b"\x01", b"\x02", b"\x03", b"\x04"
OP_GET, OP_SUGGEST, OP_WATCH = b"G", b"S", b"W"
MAX_REQUEST = 16 + (1 << 17)  # a manifest tag and a bitfield of up to 2**20 shards
CHUNK = 1 << 16
MAX_WATCHERS = 256  # watch streams one peer serves per version
MAX_PIPELINED = 4  # requests one peer may have waiting behind its upload in progress; more are answered busy
LINGER_S = 10.0  # after answering, how long a stream waits for the asker to close it
_HEX64 = re.compile(rb"^[0-9a-f]{64}$")


async def _discard_until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(CHUNK):
        pass


class TokenBucket:
    """Bytes per second with a small burst, shared by all uploads; `take` waits until the bytes may go out."""

    def __init__(self, rate_bytes_s: float, burst: float = 4 * CHUNK, clock: Any = time.monotonic,
                 sleep: Any = asyncio.sleep):
        self.rate = rate_bytes_s
        self.burst = max(burst, CHUNK)
        self.tokens = self.burst
        self.clock, self.sleep = clock, sleep
        self.last = clock()

    async def take(self, n: int) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        self.tokens -= n  # may go negative: a debt that this caller waits out and later callers inherit
        if self.tokens < 0:
            await self.sleep(-self.tokens / self.rate)


@dataclass
class ServedVersion:
    """One checkpoint version this peer serves, and what it has announced of it."""

    manifest: CheckpointManifest
    store: ShardStore
    index: dict[str, tuple[int, ...]]  # shard sha -> its indices in manifest.shards()
    n_shards: int
    held: set[int] = field(default_factory=set)
    ever_held: bool = False  # once true, an empty `held` means pruned from disk (not "nothing yet")
    announced: bytes | None = None
    announced_at: float = 0.0
    retired: bool = False
    watchers: set[asyncio.Queue[int]] = field(default_factory=set)  # open watch streams (see _serve_watch)


@dataclass
class _Handout:
    given: int = 0  # uploads started or promised by a suggestion
    active: int = 0  # uploads in progress
    quiet_at: float = 0.0  # before this (monotonic) time the last copy is presumed still on its way


@dataclass
class _Asker:
    """A peer this peer is uploading to: its requests are served one at a time, in one upload slot."""

    lock: asyncio.Lock
    requests: int = 0  # its requests in progress or waiting here
    has_slot: bool = False  # one of the max_uploads slots is held for it


class ShardServer:
    """Serves the verified shards of the versions given to `serve`, to any peer not in `banned`.

    Thread-safe: `serve`, `retire` and `mark_held` may be called from any thread; the rest runs on the
    event loop given to `start`. `on_change` is called (from any thread) whenever holdings change.
    """

    def __init__(self, config: P2PConfig, stats: SwarmStats, banned: set[str], on_change: Callable[[], None]):
        self.config = config
        self.stats = stats
        self.banned = banned  # shared with the peer: a banned peer is refused
        self.on_change = on_change
        self.lock = threading.Lock()  # guards `served`, `handouts`, `serving`
        self.served: dict[str, ServedVersion] = {}  # manifest tag -> the version
        self.handouts: dict[str, _Handout] = {}  # shard sha -> how this peer has handed it out
        self.askers: dict[str, _Asker] = {}  # peer id -> its uploads here
        self.serving = 0  # uploads in progress or waiting for a slot
        self._loop: asyncio.AbstractEventLoop | None = None
        self._upload_sem: asyncio.Semaphore | None = None
        self._upload_waiting = 0  # requests waiting for an upload slot (not those pipelined behind their asker's)
        self._ramp: asyncio.Condition | None = None  # a seed's ramp-up (see _ramp_up)
        self._ramp_active = 0
        self._ramp_done = 0
        self._bucket: TokenBucket | None = None

    def start(self) -> None:
        """Bind to the running event loop (call from it, before the stream handler is registered)."""
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._upload_sem = asyncio.Semaphore(cfg.seed_max_uploads if cfg.seed else cfg.max_uploads)
        self._ramp = asyncio.Condition()
        if cfg.upload_cap_mbps is not None:
            self._bucket = TokenBucket(cfg.upload_cap_mbps * 1e6 / 8)

    def serve(self, manifest: CheckpointManifest, store: ShardStore) -> None:
        """Serve the shards of `manifest` that are (or come to be) in `store`; `on_change` tells the owner,
        which announces them (see SwarmPeer.serve)."""
        info = manifest_info(manifest)
        tag, index = info.tag, info.index
        with self.lock:
            if tag in self.served:
                return
            served = ServedVersion(manifest, store, index, len(info.shards))
            self._ramp_done = 0  # a seed ramps up again for a new version
            served.held = {i for sha, idx in index.items() if store.has(sha) for i in idx}
            served.ever_held = bool(served.held)
            self.served[tag] = served
        self.on_change()

    def retire(self, manifest: CheckpointManifest) -> None:
        """Stop serving `manifest`: its watch streams end, and `on_change` has the owner empty its record."""
        with self.lock:
            served = self.served.get(manifest_tag(manifest))
            if served is None:
                return
            served.retired = True
            served.held = set()
            watchers = list(served.watchers)
        self._tell(watchers, [-1])
        self.on_change()

    def mark_held(self, manifest: CheckpointManifest, shard: ShardRef) -> None:
        """`shard` of `manifest` has just been verified and stored: its watchers hear of it now, and
        `on_change` has the owner announce it."""
        with self.lock:
            served = self.served.get(manifest_tag(manifest))
            if served is None or served.retired:
                return
            new = [i for i in served.index.get(shard.sha256, ()) if i not in served.held]
            served.held.update(new)
            served.ever_held = True
            watchers = list(served.watchers)
        self._tell(watchers, new)
        self.on_change()

    def _tell(self, watchers: list[asyncio.Queue[int]], indices: list[int]) -> None:
        """Queue `indices` (or -1: the end) for the given watch streams, from any thread."""
        if watchers and indices and self._loop is not None:
            def put() -> None:
                for q in watchers:
                    for i in indices:
                        q.put_nowait(i)

            self._loop.call_soon_threadsafe(put)

    def load_shard(self, sha: str) -> bytes | None:
        """The bytes of a verified shard this peer holds, or None."""
        with self.lock:
            stores = {id(s.store): s.store for s in self.served.values() if not s.retired}
        for store in stores.values():
            try:
                return store.get(sha)
            except OSError:
                continue
        return None

    async def handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = info.peer_id.to_base58()
        try:
            op = await asyncio.wait_for(reader.readexactly(1), 30)
            length = int.from_bytes(await asyncio.wait_for(reader.readexactly(P2P.HEADER_LEN), 30), P2P.BYTEORDER)
            if length > MAX_REQUEST:
                return
            payload = await asyncio.wait_for(reader.readexactly(length), 30)
            if remote in self.banned:
                self.stats.refused += 1
                writer.write(REFUSED)
            elif op == OP_GET and _HEX64.match(payload):
                await self._send_shard(payload.decode(), writer, remote)
            elif op == OP_WATCH and len(payload) == 16:
                await self._serve_watch(payload.decode("ascii", "replace"), writer)
            elif op == OP_SUGGEST:
                idx = self.suggest_for(payload)
                if isinstance(idx, int):
                    writer.write(OK + idx.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
                else:
                    writer.write(NOT_HELD if idx is None else LATER)
            else:
                writer.write(REFUSED)
            await writer.drain()
            # Wait for the asker to close the stream once it has read everything, and only then close ours.
            # The daemon (p2pd) closes the libp2p stream when this connection closes; that races with its
            # other direction, which then resets the stream and drops the bytes not yet sent: about one
            # upload in a thousand lost its last 64 KiB. Half-closing first races the same way.
            await asyncio.wait_for(_discard_until_eof(reader), LINGER_S)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, OSError) as e:
            log.debug("serving %s: %s", remote[-8:], e)
        finally:
            writer.close()

    async def _send_shard(self, sha: str, writer: asyncio.StreamWriter, remote: str) -> None:
        assert self._upload_sem is not None
        asker = self.askers.get(remote)
        if asker is None:
            asker = self.askers[remote] = _Asker(asyncio.Lock())
        # A request from a peer that already has an upload here (in progress or waiting) is pipelined: it waits
        # behind that one, in the same upload slot, and starts the moment it ends, without the round trip a
        # request sent only then would cost. Such requests never count against the busy rule.
        follows = asker.requests > 0
        if follows and asker.requests > MAX_PIPELINED:
            self.stats.busy += 1
            writer.write(BUSY)
            return
        if (not follows and self._upload_sem.locked() and self._upload_waiting >= self.config.upload_queue
                and not self.config.seed):
            # Every upload slot is taken and enough askers wait for one: say so at once, and the asker takes
            # this shard (or another) from a less loaded holder meanwhile. Seeds queue everyone instead.
            self.stats.busy += 1
            writer.write(BUSY)
            return
        with self.lock:  # in progress from now on, also while waiting for an upload slot
            h = self._handout(sha)
            if h.active == 0 and time.monotonic() >= h.quiet_at:
                h.given += 1  # not announced by a suggestion
            h.active += 1
            self.serving += 1
        asker.requests += 1
        try:
            async with asker.lock:  # one upload per asker at a time, in request order
                if not asker.has_slot:
                    self._upload_waiting += 1
                    try:
                        await self._upload_sem.acquire()
                    finally:
                        self._upload_waiting -= 1
                    asker.has_slot = True
                await self._upload(sha, writer)
        finally:
            asker.requests -= 1
            if asker.requests == 0:  # the asker's last request here: its slot goes to the next asker
                if asker.has_slot:
                    asker.has_slot = False
                    self._upload_sem.release()
                self.askers.pop(remote, None)
            with self.lock:
                h.active -= 1
                self.serving -= 1
                h.quiet_at = time.monotonic() + self.config.seed_grace_s

    async def _upload(self, sha: str, writer: asyncio.StreamWriter) -> None:
        """Send one shard (status, length, bytes) through the upload cap; the caller holds an upload slot."""
        if self.config.seed:
            await self._ramp_up()
        try:
            data = await asyncio.get_running_loop().run_in_executor(None, self.load_shard, sha)
            if data is None:
                writer.write(NOT_HELD)
                return
            writer.write(OK + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            view = memoryview(data)
            for off in range(0, len(view), CHUNK):
                piece = view[off : off + CHUNK]
                if self._bucket is not None:
                    await self._bucket.take(len(piece))
                writer.write(piece)
                await writer.drain()
            self.stats.uploads += 1
            self.stats.bytes_uploaded += len(data)
            self.stats.last_upload_at = time.time()
        finally:
            if self.config.seed:
                self._ramp_release()

    async def _serve_watch(self, tag: str, writer: asyncio.StreamWriter) -> None:
        """Stream what this peer holds of one version: its bitfield now, then each shard index as it is stored,
        until it holds them all, stops serving the version, or the watcher goes away."""
        q: asyncio.Queue[int] = asyncio.Queue()
        with self.lock:
            served = self.served.get(tag)
            if served is None or served.retired:
                writer.write(NOT_HELD)
                return
            if len(served.watchers) >= MAX_WATCHERS:
                writer.write(BUSY)
                return
            served.watchers.add(q)
            bits = make_bitfield(served.n_shards, served.held)
            complete = len(served.held) >= served.n_shards
        try:
            writer.write(OK + len(bits).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + bits)
            await writer.drain()
            while not complete:
                batch = [await q.get()]
                while not q.empty():
                    batch.append(q.get_nowait())
                if -1 in batch:
                    return
                writer.write(b"".join(i.to_bytes(4, "big") for i in batch))
                await writer.drain()
                with self.lock:
                    complete = len(served.held) >= served.n_shards
        finally:
            with self.lock:
                served.watchers.discard(q)

    async def _ramp_up(self) -> None:
        """A seed starts a new version with one upload at a time and adds one per upload that ends.

        At first nobody's download link is busy, so one upload at full rate lands a first copy (which can
        then spread) soonest; later each copy shares its receiver's link with peer traffic, and more
        uploads at once keep the seed's link full.
        """
        assert self._ramp is not None
        async with self._ramp:
            await self._ramp.wait_for(lambda: self._ramp_active < 1 + self._ramp_done)
            self._ramp_active += 1

    def _ramp_release(self) -> None:
        self._ramp_active -= 1
        self._ramp_done += 1
        if self._ramp is not None and self._loop is not None:
            async def notify() -> None:
                async with self._ramp:  # type: ignore[union-attr]
                    self._ramp.notify_all()  # type: ignore[union-attr]

            asyncio.ensure_future(notify())

    def _handout(self, sha: str) -> _Handout:
        h = self.handouts.get(sha)
        if h is None:
            if len(self.handouts) > 1 << 16:
                self.handouts.clear()
            h = self.handouts[sha] = _Handout()
        return h

    def suggest_for(self, payload: bytes) -> int | None | bytes:
        """Super-seeding: which of the shards a peer still wants this peer (a seed) should send it, if any.

        The seed's one link is the swarm's bottleneck, so it sends every shard once before it sends any
        twice, and lets the copies spread peer to peer: it suggests a wanted shard it has never handed
        out; if there is none but other peers still have never-handed shards to get, the answer is LATER
        (take these from the peers). Once every shard has been handed out, it helps with the least handed
        out wanted shard, preferring one not still on its way to some peer (an upload in progress, or ended
        less than `seed_grace_s` ago: the time its receiver needs to announce it); it suggests one on its way
        too while it serves fewer than `seed_max_uploads`, since its link would otherwise idle. A suggestion counts as a
        hand-out, which keeps concurrent askers apart. Returns an index, None (no opinion) or LATER.
        """
        tag, bits = payload[:16].decode("ascii", "replace"), payload[16:]
        now = time.monotonic()
        with self.lock:
            served = self.served.get(tag)
            if served is None or served.retired or len(bits) != (served.n_shards + 7) // 8:
                return None
            wanted = bitfield_indices(bits, served.n_shards) & served.held
            if not wanted:
                return None
            shards = manifest_info(served.manifest).shards

            def given(i: int) -> int:
                h = self.handouts.get(shards[i].sha256)
                return 0 if h is None else h.given

            def in_transit(i: int) -> bool:
                h = self.handouts.get(shards[i].sha256)
                return h is not None and (h.active > 0 or now < h.quiet_at)

            fresh = [i for i in wanted if given(i) == 0]
            if fresh:
                best = random.choice(fresh)
            elif any(given(i) == 0 for i in served.held):
                return LATER
            else:
                ready = [i for i in wanted if not in_transit(i)]
                if not ready:
                    if self.serving >= self.config.seed_max_uploads:
                        return LATER
                    # The seed's link has room: a second copy now beats an idle link while the last shards
                    # crawl from the few peers that hold them (the end of a broadcast).
                    ready = list(wanted)
                best = min(ready, key=lambda i: (given(i), random.random()))
            h = self._handout(shards[best].sha256)
            h.given += 1
            h.quiet_at = now + self.config.seed_grace_s  # the asker's request should follow at once
            return best
