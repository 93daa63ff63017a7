"""A swarm peer: this process's presence in the checkpoint swarm (hivemind DHT + libp2p streams).

`SwarmPeer` runs one libp2p daemon (p2pd) and one hivemind `DHTNode` on an asyncio loop in a background thread
of the calling process, and puts together the parts that do the work, one job each:

- `serving.ShardServer`: serves every shard held in the `ShardStore`s it is given (`serve`): those hold only
  shards whose hash was checked when they were stored, so a shard is served as soon as it is held;
- `discovery.Announcer`: announces, per version, which shards it holds (owner-signed DHT records, dht.py);
- `discovery.HolderDirectory` and `watch.Watches`: who holds what (`holders`), from the DHT and watch streams;
- `client.ShardClient`: fetches a shard from a given peer (`fetch`), asks a seed for a suggestion (`suggest`);
- `health.PeerHealth`: the ban list (peers that served bad bytes: never asked again, nor served) and the drop
  list (peers that failed or were too slow `max_peer_failures` times in a row: left alone for `drop_s`).

`sources.SwarmSource(peer)` plugs it into `transfer.fetcher.CheckpointFetcher`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

from swarmrl.protocol.manifest import CheckpointManifest, ShardRef
from swarmrl.transfer.p2p.client import ShardClient
from swarmrl.transfer.p2p.config import P2PConfig
from swarmrl.transfer.p2p.dht import (
    CachingSignatureValidator,
    HolderRecord,
    full_maddrs,
    manifest_tag,
)
from swarmrl.transfer.p2p.discovery import Announcer, HolderDirectory
from swarmrl.transfer.p2p.health import PeerHealth
from swarmrl.transfer.p2p.host import LoopThread, open_dht
from swarmrl.transfer.p2p.serving import ShardServer
from swarmrl.transfer.p2p.watch import Watches
from swarmrl.transfer.p2p.wire import PROTOCOL, PeerError, SwarmStats
from swarmrl.transfer.store import ShardStore

log = logging.getLogger(__name__)


class SwarmPeer(LoopThread):
    """This process's presence in the swarm: DHT membership, shard serving, peer fetching, bans.

        peer = SwarmPeer(cfg, run_id, initial_peers=run_info.dht_peers).start()
        fetcher = CheckpointFetcher(root, key, [SwarmSource(peer), HttpOrigin(client)], config=fetch_cfg)
        ...
        peer.close()
    """

    thread_name = "swarm-p2p"
    what = "the swarm peer"
    not_running = PeerError

    def __init__(self, config: P2PConfig, run_id: str, *, initial_peers: list[str] | None = None):
        super().__init__(config.startup_timeout_s)
        self.config = config
        self.run_id = run_id
        self.initial_peers = list(initial_peers if initial_peers is not None else config.initial_peers)
        # Only a bootstrap peer (the coordinator hands these out) is believed when it says it is a seed: a seed
        # gets the scheduler's deference (its hints, its LATER), which no stranger should be able to claim.
        self.trusted_seeds = {a.rsplit("/p2p/", 1)[1] for a in self.initial_peers if "/p2p/" in a}
        self.stats = SwarmStats()
        self.health = PeerHealth(config, self.stats)
        self.banned = self.health.banned
        self.server = ShardServer(config, self.stats, self.banned, self._poke)
        self.client = ShardClient(config, self.stats, self.call)
        self.watches = Watches(config, self.stats, self.client, self.banned)
        self.directory = HolderDirectory(config, run_id, self.stats, self.banned, self.watches, self.client,
                                         self.call, self.submit)
        self.announcer = Announcer(config, run_id, self.stats, self.server)
        self._p2p: P2P | None = None
        self._dht: DHTNode | None = None
        self._rsa: CachingSignatureValidator | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.peer_id: str = ""
        self.maddrs: list[str] = []

    # -- lifecycle -------------------------------------------------------------------------------------

    async def _start(self) -> None:
        """Start the daemon, join the DHT, begin serving and announcing (`start` runs it, within the startup
        timeout; `close` undoes it)."""
        cfg = self.config
        self._p2p, self._dht, self._rsa = await open_dht(
            initial_peers=self.initial_peers, host_maddrs=cfg.host_maddrs, announce_maddrs=cfg.announce_maddrs,
            identity_path=cfg.identity_path, startup_timeout_s=cfg.startup_timeout_s,
            wait_timeout_s=cfg.dht_wait_timeout_s)
        self.peer_id = self._p2p.peer_id.to_base58()
        self.maddrs = full_maddrs(await self._p2p.get_visible_maddrs(), self._p2p.peer_id)
        self.client.attach(self._p2p)
        self.directory.attach(self._dht, self.peer_id)
        self.server.start()
        await self._p2p.add_binary_stream_handler(PROTOCOL, self.server.handle)
        self._tasks.append(self.announcer.start(self._dht, self._rsa, self.peer_id, self.maddrs))

    async def _stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._dht is not None:
            await self._dht.shutdown()
        if self._p2p is not None:
            await self._p2p.shutdown()

    def _poke(self) -> None:
        self.announcer.poke()

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
        self.watches.forget(manifest_tag(manifest))

    def mark_held(self, manifest: CheckpointManifest, shard: ShardRef) -> None:
        """`shard` of `manifest` has just been verified and stored: its watchers hear of it now, the DHT soon."""
        self.server.mark_held(manifest, shard)

    # -- asking others -----------------------------------------------------------------------------------

    def holders(self, manifest: CheckpointManifest, wait: bool = False) -> dict[str, HolderRecord]:
        """Peer id -> what it holds of `manifest` (not this peer; banned peers excluded); see HolderDirectory."""
        return self.directory.holders(manifest, wait)

    def fetch(self, peer_id: str, shard: ShardRef, timeout: float | None = None) -> bytes:
        """The bytes `peer_id` sends for `shard` (unverified). PeerError, TimeoutError, SourceBusy or
        BadShardBytes."""
        return self.client.fetch(peer_id, shard, timeout)

    def suggest(self, peer_id: str, manifest: CheckpointManifest, wanted: list[ShardRef]) -> ShardRef | object | None:
        """Which of `wanted` the peer (a seed) would rather send: a shard, WAIT, or None."""
        return self.client.suggest(peer_id, manifest, wanted)

    # -- peer health -------------------------------------------------------------------------------------

    def usable(self, peer_id: str) -> bool:
        """Neither banned nor currently dropped."""
        return self.health.usable(peer_id)

    def ban(self, peer_id: str, reason: str = "") -> None:
        """Never ask `peer_id` again and refuse its requests, for the rest of this process."""
        self.health.ban(peer_id, reason)

    def strike(self, peer_id: str) -> None:
        """One more failure of `peer_id`; enough in a row and it is dropped for `drop_s`."""
        self.health.strike(peer_id)

    def forgive(self, peer_id: str) -> None:
        """`peer_id` delivered: its run of failures is over."""
        self.health.forgive(peer_id)
