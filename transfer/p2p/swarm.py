"""Serving and fetching checkpoint shards over hivemind's libp2p streams, with discovery through its DHT.

A `SwarmPeer` runs one libp2p daemon (p2pd) and one hivemind `DHTNode` on an asyncio loop in a background
thread of the calling process. It

- serves every shard held in the `ShardStore`s it was given (`serve`): those hold only shards whose hash
  was checked when they were stored, so a shard is served as soon as it is held and verified;
- announces, per checkpoint version, which shards it holds in an owner-signed DHT record (see `dht.py`),
  refreshed every third of `record_ttl_s`; the first at once (empty while it holds nothing yet), then new
  shards at most every `announce_interval_s`;
- reads who holds what (`holders`), fetches a shard from a given peer (`fetch`), and keeps the ban list
  (peers that served bad bytes: never asked again, nor served) and the drop list (peers that failed or
  were too slow `max_peer_failures` times in a row: left alone for `drop_s`).

`source()` plugs all this into `transfer.fetcher.CheckpointFetcher` (see `sources.py`).

Serving (uploads, watch streams, a seed's hints) and the wire protocol are in `serving.py`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import get_dht_time

from swarmrl.protocol.manifest import CheckpointManifest, ShardRef
from swarmrl.transfer.p2p.config import P2PConfig
from swarmrl.transfer.p2p.dht import (
    CachingSignatureValidator,
    HolderRecord,
    bitfield_indices,
    full_maddrs,
    holders_key,
    make_bitfield,
    manifest_info,
    manifest_tag,
    parse_holders,
)
from swarmrl.transfer.p2p.host import open_dht
from swarmrl.transfer.p2p.serving import (
    BUSY,
    LATER,
    NOT_HELD,
    OK,
    OP_GET,
    OP_SUGGEST,
    OP_WATCH,
    PROTOCOL,
    ShardServer,
)
from swarmrl.transfer.p2p.sources import PeerError, SwarmSource
from swarmrl.transfer.sources import WAIT, BadShardBytes, SourceBusy
from swarmrl.transfer.store import ShardStore

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


@dataclass
class _Holders:
    records: dict[str, HolderRecord]
    at: float
    every: float  # re-read the DHT after this many seconds (see _refresh)
    refreshing: bool = False


@dataclass
class SwarmStats:
    uploads: int = 0
    bytes_uploaded: int = 0
    refused: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    peer_failures: int = 0
    announces: int = 0  # holder records stored in the DHT
    dht_reads: int = 0  # holder records read from the DHT
    busy: int = 0  # requests answered "busy" (all upload slots taken)
    haves: int = 0  # shards that watched peers reported holding after their watch began
    wait_s: float = 0.0  # downloads: seconds from sending a request to the holder's answer (queue, RTT, disk)
    transfer_s: float = 0.0  # downloads: seconds from the answer to the last byte
    last_upload_at: float = 0.0  # wall clock (time.time()) when the latest upload ended


class SwarmPeer:
    """This process's presence in the swarm: DHT membership, shard serving, peer fetching, bans.

        peer = SwarmPeer(cfg, run_id, initial_peers=run_info.dht_peers).start()
        fetcher = CheckpointFetcher(root, key, [peer.source(), HttpOrigin(client)], **peer.fetcher_options())
        ...
        peer.close()
    """

    def __init__(self, config: P2PConfig, run_id: str, *, initial_peers: list[str] | None = None):
        self.config = config
        self.run_id = run_id
        self.initial_peers = list(initial_peers if initial_peers is not None else config.initial_peers)
        # Only a bootstrap peer (the coordinator hands these out) is believed when it says it is a seed: a seed
        # gets the scheduler's deference (its hints, its LATER), which no stranger should be able to claim.
        self.trusted_seeds = {a.rsplit("/p2p/", 1)[1] for a in self.initial_peers if "/p2p/" in a}
        self.banned: set[str] = set()
        self.stats = SwarmStats()
        self._strikes: dict[str, int] = {}
        self._dropped_until: dict[str, float] = {}
        self._holders: dict[str, _Holders] = {}
        self._live: dict[str, dict[str, _Live]] = {}  # manifest tag -> peer id -> what its watch reported
        # (tag, peer id) -> when a new watch may be opened: never while one is open or after the peer ended it
        # (it holds everything, or dropped the version); a while after a failure.
        self._watching: dict[tuple[str, str], float] = {}
        self._watch_tasks: set[asyncio.Task[None]] = set()
        self._addrs: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._p2p: P2P | None = None
        self._dht: DHTNode | None = None
        self._rsa: CachingSignatureValidator | None = None
        self._announce_event: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.server = ShardServer(config, self.stats, self.banned, self._poke)
        self.peer_id: str = ""
        self.maddrs: list[str] = []

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> SwarmPeer:
        """Start the daemon, join the DHT, begin serving. Raises if that fails within startup_timeout_s."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="swarm-p2p", daemon=True)
        self._thread.start()
        try:
            self._call(self._start(), timeout=self.config.startup_timeout_s + 10)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop serving and announcing, leave the DHT, stop the daemon. Safe to call twice."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._stop(), loop).result(15)
            except Exception as e:  # noqa: BLE001 (best effort on the way out)
                log.debug("swarm shutdown: %s", e)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        if not loop.is_running():
            loop.close()

    def __enter__(self) -> SwarmPeer:
        return self.start() if self._loop is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fetcher_options(self) -> dict[str, int | float | bool]:
        """Keyword arguments for CheckpointFetcher: peer slots plus seed slots, the peers kept to theirs,
        how to play the end game, and how to choose peers."""
        cfg = self.config
        return {"max_parallel": cfg.max_parallel_peers * cfg.requests_per_peer + cfg.origin_parallel,
                "max_peer_parallel": cfg.max_parallel_peers, "endgame": cfg.endgame,
                "endgame_patience": cfg.endgame_patience,
                "spread_holders": cfg.spread_holders}

    def source(self) -> SwarmSource:
        """This peer as a source for CheckpointFetcher: it expands into one source per holder of a version."""
        return SwarmSource(self)

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        if self._loop is None:
            raise PeerError("the swarm peer is not running")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError as e:
            fut.cancel()
            raise TimeoutError(f"timed out after {timeout} s") from e

    async def _start(self) -> None:
        cfg = self.config
        self._p2p, self._dht, self._rsa = await open_dht(
            initial_peers=self.initial_peers, host_maddrs=cfg.host_maddrs, announce_maddrs=cfg.announce_maddrs,
            identity_path=cfg.identity_path, startup_timeout_s=cfg.startup_timeout_s,
            wait_timeout_s=cfg.dht_wait_timeout_s)
        self.peer_id = self._p2p.peer_id.to_base58()
        self.maddrs = full_maddrs(await self._p2p.get_visible_maddrs(), self._p2p.peer_id)
        self.server.start()
        self._announce_event = asyncio.Event()
        await self._p2p.add_binary_stream_handler(PROTOCOL, self.server.handle)
        self._tasks.append(asyncio.create_task(self._announce_loop()))

    async def _stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._dht is not None:
            await self._dht.shutdown()
        if self._p2p is not None:
            await self._p2p.shutdown()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    # -- serving -----------------------------------------------------------------------------------------

    def serve(self, manifest: CheckpointManifest, store: ShardStore) -> None:
        """Serve and announce the shards of `manifest` that are (or come to be) in `store`.

        A peer that holds none of them yet announces an empty record at once: the others find it, and open
        their watch streams, before its first shard lands (at the start of a broadcast, discovery through
        the DHT took seconds). Announcing continues while any of them is in the store; once none is, the
        record is emptied and the manifest forgotten.
        """
        self.server.serve(manifest, store)

    def retire(self, manifest: CheckpointManifest) -> None:
        """Stop serving `manifest`: its record is emptied now (rather than when its shards leave the disk)."""
        self.server.retire(manifest)
        tag = manifest_tag(manifest)
        with self._lock:
            self._live.pop(tag, None)
            self._watching = {k: v for k, v in self._watching.items() if k[0] != tag}

    def mark_held(self, manifest: CheckpointManifest, shard: ShardRef) -> None:
        """`shard` of `manifest` has just been verified and stored: announce it soon."""
        self.server.mark_held(manifest, shard)

    def _poke(self) -> None:
        if self._loop is not None and self._announce_event is not None:
            self._loop.call_soon_threadsafe(self._announce_event.set)

    async def _announce_loop(self) -> None:
        assert self._announce_event is not None
        refresh = self.config.record_ttl_s / 3
        wake = refresh
        while True:
            try:
                await asyncio.wait_for(self._announce_event.wait(), timeout=wake)
                await asyncio.sleep(self.config.announce_delay_s)
            except TimeoutError:
                pass
            self._announce_event.clear()
            wake = refresh
            try:
                wake = await self._announce_all()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 (try again at the next refresh)
                log.warning("announcing held shards failed: %s", e)

    async def _announce_all(self) -> float:
        """Store a fresh record for every served version whose holdings changed (or whose record is due for a
        refresh); returns the seconds until the next announcement is due, if nothing else happens.

        A version's first record goes out at once; later changes wait until `announce_interval_s` after the
        previous store, so that a peer storing shards quickly costs the DHT one signed store (verified by every
        replica) per interval rather than one per shard. Watchers hear of every shard at once anyway.
        """
        assert self._dht is not None and self._rsa is not None
        now = time.monotonic()
        refresh = self.config.record_ttl_s / 3
        wake = refresh
        with self.server.lock:
            served = list(self.server.served.items())
        newest = max((v.manifest.version for _, v in served), default=0)
        for tag, s in served:
            if now - s.announced_at > refresh and not s.retired:  # also notices shards pruned from disk
                held = await asyncio.get_running_loop().run_in_executor(
                    None, lambda s=s: {i for sha, idx in s.index.items() if s.store.has(sha) for i in idx})
                with self.server.lock:
                    if not s.retired:
                        s.held = held
            n = s.n_shards
            with self.server.lock:
                bits = make_bitfield(n, s.held)
                empty = not s.held
                s.ever_held = s.ever_held or not empty
                # Retired, pruned from disk, or never got a shard before a newer version came: forget it.
                gone = empty and (s.retired or s.ever_held or s.manifest.version < newest)
            if gone and s.announced is None:
                with self.server.lock:
                    self.server.served.pop(tag, None)
                continue
            if bits == s.announced and now - s.announced_at < refresh:
                wake = min(wake, s.announced_at + refresh - now)
                continue
            due = s.announced_at + self.config.announce_interval_s
            if s.announced is not None and not empty and now < due and now - s.announced_at < refresh:
                wake = min(wake, due - now)  # a change, but too soon after the last store: at `due`
                continue
            rec = HolderRecord(peer_id=self.peer_id, tag=tag, n_shards=n, bits=bits, seed=self.config.seed,
                               addrs=tuple(self.maddrs[:8]))
            ok = await self._dht.store(holders_key(self.run_id, s.manifest.version), rec.to_value(),
                                       get_dht_time() + self.config.record_ttl_s, subkey=self._rsa.local_public_key)
            if not ok:
                log.debug("DHT refused or lost the holder record for v%d", s.manifest.version)
            s.announced, s.announced_at = bits, now
            self.stats.announces += 1
            if gone:
                with self.server.lock:
                    self.server.served.pop(tag, None)
        return max(0.01, wake)

    # -- discovery -----------------------------------------------------------------------------------------

    def holders(self, manifest: CheckpointManifest, wait: bool = False) -> dict[str, HolderRecord]:
        """Peer id -> what it holds of `manifest`, per the DHT (not this peer; banned peers excluded).

        Cached for `poll_interval_s`, or up to 8 times that while the DHT shows no new peer and every known
        holder is watched (their watch streams carry what they store); a stale cache is refreshed in the
        background, a missing one synchronously (or whenever `wait`).
        """
        tag = manifest_tag(manifest)
        with self._lock:
            c = self._holders.get(tag)
            stale = c is None or time.monotonic() - c.at > c.every
            start = stale and (c is None or not c.refreshing)
            if c is not None and start:
                c.refreshing = True
        if c is None or wait:
            try:
                self._call(self._refresh(manifest), timeout=self.config.dht_wait_timeout_s * 3)
            except Exception as e:  # noqa: BLE001 (no holders known: the seeds remain)
                log.debug("holder lookup failed: %s", e)
        elif start and self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._refresh(manifest), self._loop)
        with self._lock:
            c = self._holders.get(tag)
            recs = dict(c.records) if c is not None else {}
            for p, live in self._live.get(tag, {}).items():  # what watched peers reported since their records
                r = recs.get(p)
                if r is None:
                    continue
                if live.merged_from is not r or live.merged_size != len(live.held):  # merged once per change
                    held = r.indices()
                    live.merged = r if live.held <= held else replace(
                        r, bits=make_bitfield(r.n_shards, held | live.held))
                    live.merged_from, live.merged_size = r, len(live.held)
                recs[p] = live.merged  # type: ignore[assignment]
        return {p: r for p, r in recs.items() if p not in self.banned}

    async def _refresh(self, manifest: CheckpointManifest) -> None:
        assert self._dht is not None
        tag = manifest_tag(manifest)
        self.stats.dht_reads += 1
        try:
            raw = await self._dht.get(holders_key(self.run_id, manifest.version), latest=True)
            recs = parse_holders(raw, manifest)
            recs.pop(self.peer_id, None)
        except Exception:
            with self._lock:  # keep what was known; retry after poll_interval_s, never block on it again
                c = self._holders.get(tag)
                self._holders[tag] = _Holders(c.records if c is not None else {}, time.monotonic(),
                                              self.config.poll_interval_s)
            raise
        with self._lock:
            # Nothing new and every holder watched: the DHT can only tell of peers that join later, so it is
            # read less often (down to every 8 poll intervals); any new peer brings the pace back.
            poll = self.config.poll_interval_s
            c = self._holders.get(tag)
            live = self._live.get(tag, {})
            quiet = c is not None and recs.keys() <= c.records.keys() and all(p in live for p in recs)
            self._holders[tag] = _Holders(recs, time.monotonic(), min(c.every * 2, poll * 8) if quiet else poll)
            for pid, r in recs.items():
                self._addrs[pid] = r.addrs
            if tag not in self._live:
                self._live[tag] = {}
                while len(self._live) > LIVE_VERSIONS:  # forget the oldest version's watches
                    old = next(iter(self._live))
                    del self._live[old]
                    self._watching = {k: v for k, v in self._watching.items() if k[0] != old}
            now = time.monotonic()
            new = [p for p in recs if self._watching.get((tag, p), 0.0) <= now and p not in self.banned]
            room = self.config.watch_peers - sum(1 for (t, _), at in self._watching.items() if t == tag and at > now)
            new = new[: max(0, room)]
            self._watching.update(((tag, p), float("inf")) for p in new)
        for pid in new:
            task = asyncio.create_task(self._watch(pid, manifest))
            self._watch_tasks.add(task)
            task.add_done_callback(self._watch_tasks.discard)

    async def _watch(self, peer_id: str, manifest: CheckpointManifest) -> None:
        """Follow what `peer_id` holds of `manifest` over a watch stream, into `_live` (see `holders`)."""
        info = manifest_info(manifest)
        tag, n = info.tag, len(info.shards)
        try:
            reader, writer = await self._open(peer_id)
            try:
                await self._request(writer, OP_WATCH, tag.encode())
                status = await asyncio.wait_for(reader.readexactly(1), self.config.peer_timeout_s)
                if status != OK:
                    raise PeerError(f"watch refused ({status!r})")
                size = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
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
                    i = int.from_bytes(await reader.readexactly(4), "big")
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

    # -- fetching from one peer --------------------------------------------------------------------------

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
        with self._lock:
            self._strikes.pop(peer_id, None)

    def fetch(self, peer_id: str, shard: ShardRef, timeout: float | None = None) -> bytes:
        """The bytes `peer_id` sends for `shard` (unverified). PeerError, TimeoutError or BadShardBytes."""
        timeout = self.config.peer_timeout_s if timeout is None else timeout
        return self._call(asyncio.wait_for(self._fetch(peer_id, shard), timeout), timeout=timeout + 1)

    def suggest(self, peer_id: str, manifest: CheckpointManifest, wanted: list[ShardRef],
                timeout: float = 1.0) -> ShardRef | object | None:
        """Which of `wanted` the peer would rather send (see `_suggest_for`): a shard, WAIT, or None."""
        if not wanted:
            return None
        info = manifest_info(manifest)
        index, n = info.index, len(info.shards)
        bits = make_bitfield(n, (i for s in wanted for i in index.get(s.sha256, ())))
        payload = info.tag.encode() + bits

        async def ask() -> int | bytes | None:
            reader, writer = await self._open(peer_id)
            try:
                await self._request(writer, OP_SUGGEST, payload)
                status = await reader.readexactly(1)
                if status != OK:
                    return status
                return int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
            finally:
                writer.close()

        try:
            i = self._call(asyncio.wait_for(ask(), timeout), timeout=timeout + 1)
        except Exception as e:  # noqa: BLE001 (a suggestion is only a hint)
            log.debug("suggestion from %s failed: %s", peer_id[-8:], e)
            return None
        if i == LATER:
            return WAIT
        if not isinstance(i, int) or not 0 <= i < n:
            return None
        pick = info.shards[i]
        return next((s for s in wanted if s.sha256 == pick.sha256), None)

    async def _open(self, peer_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        assert self._p2p is not None
        pid = PeerID.from_base58(peer_id)
        try:
            _, reader, writer = await self._p2p.call_binary_stream_handler(pid, PROTOCOL)
        except Exception:  # noqa: BLE001 (not connected yet: dial the addresses it announced, then retry)
            with self._lock:
                addrs = self._addrs.get(peer_id, ())
            try:
                await self._p2p._client.connect(pid, [Multiaddr(a) for a in addrs])  # noqa: SLF001
                _, reader, writer = await self._p2p.call_binary_stream_handler(pid, PROTOCOL)
            except Exception as e:  # noqa: BLE001
                raise PeerError(f"cannot reach peer {peer_id[-8:]}: {e}") from e
        return reader, writer

    @staticmethod
    async def _request(writer: asyncio.StreamWriter, op: bytes, payload: bytes) -> None:
        writer.write(op + len(payload).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + payload)
        await writer.drain()

    async def _fetch(self, peer_id: str, shard: ShardRef) -> bytes:
        reader, writer = await self._open(peer_id)
        try:
            t0 = time.monotonic()
            await self._request(writer, OP_GET, shard.sha256.encode())
            status = await reader.readexactly(1)
            t1 = time.monotonic()
            self.stats.wait_s += t1 - t0
            if status == BUSY:
                raise SourceBusy(f"peer {peer_id[-8:]} is busy", self.config.busy_retry_s)
            if status == NOT_HELD:
                raise PeerError(f"peer {peer_id[-8:]} does not hold shard {shard.sha256[:12]}")
            if status != OK:
                raise PeerError(f"peer {peer_id[-8:]} refused shard {shard.sha256[:12]}")
            n = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
            if n != shard.size:
                raise BadShardBytes(f"peer {peer_id[-8:]} announced {n} bytes for a {shard.size}-byte shard")
            data = await reader.readexactly(n)
            self.stats.transfer_s += time.monotonic() - t1
        except asyncio.IncompleteReadError as e:
            raise PeerError(f"peer {peer_id[-8:]} closed the stream early") from e
        finally:
            writer.close()
        self.stats.downloads += 1
        self.stats.bytes_downloaded += n
        return data
