"""The asking half of a swarm peer: one request to one peer over a libp2p stream (see wire.py).

`ShardClient` opens streams (dialling the addresses a peer announced in its DHT record when it is not connected
yet), fetches a shard (`fetch`) and asks a seed for a suggestion (`suggest`). Its blocking methods run the
request on the owner's event loop through `call` and may be used from any thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarmrl.protocol.manifest import CheckpointManifest, ShardRef
from swarmrl.transfer.p2p.config import P2PConfig
from swarmrl.transfer.p2p.dht import make_bitfield, manifest_info
from swarmrl.transfer.p2p.wire import (
    BUSY,
    LATER,
    NOT_HELD,
    OK,
    OP_GET,
    OP_SUGGEST,
    PROTOCOL,
    PeerError,
    SwarmStats,
    read_length,
    send_request,
)
from swarmrl.transfer.sources import WAIT, BadShardBytes, SourceBusy

log = logging.getLogger(__name__)

Call = Callable[[Coroutine[Any, Any, Any], float | None], Any]


class ShardClient:
    """Requests to other peers. `call(coro, timeout)` runs a coroutine on the owner's loop and returns its result
    (TimeoutError after `timeout`); `attach` gives it the started daemon."""

    def __init__(self, config: P2PConfig, stats: SwarmStats, call: Call):
        self.config = config
        self.stats = stats
        self._call = call
        self._p2p: P2P | None = None
        self._addrs: dict[str, tuple[str, ...]] = {}  # peer id -> the addresses it announced
        self._lock = threading.Lock()

    def attach(self, p2p: P2P) -> None:
        self._p2p = p2p

    def remember(self, addrs: dict[str, tuple[str, ...]]) -> None:
        """Addresses peers announced (peer id -> multiaddrs), for dialling them when not connected."""
        with self._lock:
            self._addrs.update(addrs)

    async def open(self, peer_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A new stream to `peer_id`; PeerError if it cannot be reached."""
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

    def fetch(self, peer_id: str, shard: ShardRef, timeout: float | None = None) -> bytes:
        """The bytes `peer_id` sends for `shard` (unverified). PeerError, TimeoutError, SourceBusy or
        BadShardBytes."""
        timeout = self.config.peer_timeout_s if timeout is None else timeout
        return self._call(asyncio.wait_for(self._fetch(peer_id, shard), timeout), timeout + 1)

    def suggest(self, peer_id: str, manifest: CheckpointManifest, wanted: list[ShardRef],
                timeout: float = 1.0) -> ShardRef | object | None:
        """Which of `wanted` the peer would rather send (see `SeedLedger.suggest`): a shard, WAIT, or None."""
        if not wanted:
            return None
        info = manifest_info(manifest)
        index, n = info.index, len(info.shards)
        bits = make_bitfield(n, (i for s in wanted for i in index.get(s.sha256, ())))
        payload = info.tag.encode() + bits

        async def ask() -> int | bytes | None:
            reader, writer = await self.open(peer_id)
            try:
                await send_request(writer, OP_SUGGEST, payload)
                status = await reader.readexactly(1)
                if status != OK:
                    return status
                return await read_length(reader)
            finally:
                writer.close()

        try:
            i = self._call(asyncio.wait_for(ask(), timeout), timeout + 1)
        except Exception as e:  # noqa: BLE001 (a suggestion is only a hint)
            log.debug("suggestion from %s failed: %s", peer_id[-8:], e)
            return None
        if i == LATER:
            return WAIT
        if not isinstance(i, int) or not 0 <= i < n:
            return None
        pick = info.shards[i]
        return next((s for s in wanted if s.sha256 == pick.sha256), None)

    async def _fetch(self, peer_id: str, shard: ShardRef) -> bytes:
        reader, writer = await self.open(peer_id)
        try:
            t0 = time.monotonic()
            await send_request(writer, OP_GET, shard.sha256.encode())
            status = await reader.readexactly(1)
            t1 = time.monotonic()
            self.stats.wait_s += t1 - t0
            if status == BUSY:
                raise SourceBusy(f"peer {peer_id[-8:]} is busy", self.config.busy_retry_s)
            if status == NOT_HELD:
                raise PeerError(f"peer {peer_id[-8:]} does not hold shard {shard.sha256[:12]}")
            if status != OK:
                raise PeerError(f"peer {peer_id[-8:]} refused shard {shard.sha256[:12]}")
            n = await read_length(reader)
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
