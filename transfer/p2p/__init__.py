"""Peer-to-peer checkpoint distribution: discovery in a hivemind DHT, shard exchange over libp2p streams.

A node process (`transfer.connect.open_fetcher` does this for nodes and verifiers):

    from swarmrl.transfer.p2p import P2PConfig, start_swarm
    from swarmrl.transfer.p2p.sources import SwarmSource
    peer = start_swarm(cfg.p2p, run_info.run_id, run_info.dht_peers)   # None: disabled or failed to start
    sources = ([SwarmSource(peer)] if peer else []) + [HttpOrigin(client)]
    fetcher = CheckpointFetcher(root, key, sources, keep_versions, config=cfg.fetch)
    ...
    if peer:
        peer.close()

The coordinator runs `transfer.seed.DhtSeed` (a bootstrap peer that seeds its shard store).
Modules, each importing only those before it: `config` (P2PConfig), `wire` (the stream protocol, PeerError,
SwarmStats), `dht` (holder records, their validators, identities), `host` (starting a daemon and a DHTNode:
`open_dht`, and `DhtHost` for users of the bare DHT), `health` (bans and drops), `seeding` (a seed's
super-seeding and ramp-up), `serving` (ShardServer: uploads, watch streams, seed hints), `client` (requests to one
peer), `watch` (following holders' watch streams), `discovery` (announcing, reading holder records), `swarm`
(SwarmPeer, which puts them together), `sources` (SwarmSource, PeerSource: the swarm as the fetcher sees it).
Importing `swarm` imports hivemind (and torch): a few seconds, so it is imported only when needed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from swarmrl.transfer.p2p.config import P2PConfig

if TYPE_CHECKING:
    from swarmrl.transfer.p2p.swarm import SwarmPeer

log = logging.getLogger(__name__)


def start_swarm(config: P2PConfig, run_id: str, dht_peers: list[str] | None = None) -> SwarmPeer | None:
    """This node's started SwarmPeer, bootstrapped from `config.initial_peers` or else `dht_peers` (the
    coordinator's RunInfo.dht_peers); None when p2p is disabled or the daemon/DHT cannot start, in which case
    the node fetches from the HTTP origin alone."""
    if not config.enabled:
        return None
    from swarmrl.transfer.p2p.swarm import SwarmPeer

    peers = config.initial_peers or list(dht_peers or [])
    try:
        return SwarmPeer(config, run_id, initial_peers=peers).start()
    except Exception as e:  # noqa: BLE001 (the origin still works: degrade, do not die)
        log.warning("peer-to-peer checkpoint sharing unavailable (%s: %s); using the origin only",
                    type(e).__name__, e)
        return None


__all__ = ["P2PConfig", "start_swarm"]
