"""The serving half of a swarm peer: the versions it serves, its uploads, its watch streams, a seed's hints.

`SwarmPeer` (swarm.py) owns one `ShardServer` and registers `ShardServer.handle` for stream
`wire.PROTOCOL` (the wire protocol is described in `wire.py`).

Uploads pass through one token bucket (`upload_cap_mbps`); at most `max_uploads` run at once and
`upload_queue` more wait, further requests are answered busy (a seed runs `seed_max_uploads` at once and
queues everyone else, and ramps up, see `seeding.RampUp`). One peer's requests are served one at a time in
one slot: a request from a peer that already has an upload here waits behind it (pipelining; at most
MAX_PIPELINED) and never counts as busy. A seed's suggestions are `seeding.SeedLedger`'s.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swarmrl.protocol.manifest import CheckpointManifest, ShardRef
from swarmrl.transfer.p2p.config import P2PConfig
from swarmrl.transfer.p2p.dht import bitfield_indices, make_bitfield, manifest_info, manifest_tag
from swarmrl.transfer.p2p.seeding import RampUp, SeedLedger
from swarmrl.transfer.p2p.wire import (
    BUSY,
    CHUNK,
    HAVE_BYTES,
    LATER,
    MAX_REQUEST,
    NOT_HELD,
    OK,
    OP_GET,
    OP_SUGGEST,
    OP_WATCH,
    REFUSED,
    SwarmStats,
    encode_length,
    read_length,
)
from swarmrl.transfer.store import ShardStore

log = logging.getLogger(__name__)

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
        self.lock = threading.Lock()  # guards `served`, `ledger`, `serving`
        self.served: dict[str, ServedVersion] = {}  # manifest tag -> the version
        self.ledger = SeedLedger(config.seed_grace_s, config.seed_max_uploads)  # how each shard was handed out
        self.askers: dict[str, _Asker] = {}  # peer id -> its uploads here
        self.serving = 0  # uploads in progress or waiting for a slot
        self.streams = 0  # streams being answered (the handler has not returned yet)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._upload_sem: asyncio.Semaphore | None = None
        self._upload_waiting = 0  # requests waiting for an upload slot (not those pipelined behind their asker's)
        self._ramp = RampUp()
        self._bucket: TokenBucket | None = None

    def start(self) -> None:
        """Bind to the running event loop (call from it, before the stream handler is registered)."""
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._upload_sem = asyncio.Semaphore(cfg.seed_max_uploads if cfg.seed else cfg.max_uploads)
        self._ramp.start()
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
            self._ramp.restart()  # a seed ramps up again for a new version
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
        """Answer one request (see wire.py), then wait for the asker to close the stream before closing ours."""
        remote = info.peer_id.to_base58()
        self.streams += 1
        try:
            op = await asyncio.wait_for(reader.readexactly(1), 30)
            length = await asyncio.wait_for(read_length(reader), 30)
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
                    writer.write(OK + encode_length(idx))
                else:
                    writer.write(NOT_HELD if idx is None else LATER)
            else:
                writer.write(REFUSED)
            await writer.drain()
            # Wait for the asker to close the stream once it has read everything, and only then close ours.
            # The daemon (p2pd) closes the libp2p stream when this connection closes; that races with its
            # other direction, which then resets the stream and drops the bytes not yet sent: about one
            # upload in a thousand lost its last 64 KiB. Half-closing first races the same way.
            try:
                await asyncio.wait_for(_discard_until_eof(reader), LINGER_S)
            except TimeoutError:
                self.stats.linger_timeouts += 1
                raise
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, OSError) as e:
            log.debug("serving %s: %s", remote[-8:], e)
        finally:
            self.streams -= 1
            writer.close()

    async def _send_shard(self, sha: str, writer: asyncio.StreamWriter, remote: str) -> None:
        assert self._upload_sem is not None
        asker = self.askers.get(remote)
        # A request from a peer that already has an upload here (in progress or waiting) is pipelined: it waits
        # behind that one, in the same upload slot, and starts the moment it ends, without the round trip a
        # request sent only then would cost. Such requests never count against the busy rule.
        follows = asker is not None and asker.requests > 0
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
        if asker is None:  # made only now: an asker answered busy is not remembered
            asker = self.askers[remote] = _Asker(asyncio.Lock())
        with self.lock:  # in progress from now on, also while waiting for an upload slot
            h = self.ledger.upload_begins(sha, time.monotonic())
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
                self.ledger.upload_ends(h, time.monotonic())
                self.serving -= 1

    async def _upload(self, sha: str, writer: asyncio.StreamWriter) -> None:
        """Send one shard (status, length, bytes) through the upload cap; the caller holds an upload slot."""
        if self.config.seed:
            await self._ramp.acquire()
        try:
            data = await asyncio.get_running_loop().run_in_executor(None, self.load_shard, sha)
            if data is None:
                writer.write(NOT_HELD)
                return
            writer.write(OK + encode_length(len(data)))
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
                self._ramp.release()

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
            writer.write(OK + encode_length(len(bits)) + bits)
            await writer.drain()
            while not complete:
                batch = [await q.get()]
                while not q.empty():
                    batch.append(q.get_nowait())
                if -1 in batch:
                    return
                writer.write(b"".join(i.to_bytes(HAVE_BYTES, "big") for i in batch))
                await writer.drain()
                with self.lock:
                    complete = len(served.held) >= served.n_shards
        finally:
            with self.lock:
                served.watchers.discard(q)

    def suggest_for(self, payload: bytes) -> int | None | bytes:
        """Super-seeding: which of the shards a peer still wants (`payload`: manifest tag + bitfield) this peer
        should send it: an index, None (no opinion) or LATER; see `SeedLedger.suggest`."""
        tag, bits = payload[:16].decode("ascii", "replace"), payload[16:]
        now = time.monotonic()
        with self.lock:
            served = self.served.get(tag)
            if served is None or served.retired or len(bits) != (served.n_shards + 7) // 8:
                return None
            return self.ledger.suggest(manifest_info(served.manifest).shards, served.held,
                                       bitfield_indices(bits, served.n_shards), self.serving, now)
