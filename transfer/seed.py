"""The coordinator's seed in the checkpoint swarm: a DHT bootstrap peer that also serves the shard store.

Nodes bootstrap their DHT from `RunInfo.dht_peers`; the coordinator fills that list with
`seed.bootstrap_peers` (the seed's multiaddrs, /p2p/<peer id> included). The seed announces every published
manifest as held in full, flagged as a seed, so nodes take from it only the shards no other peer holds yet
(rarest first) and otherwise fetch from each other. The HTTP origin stays as the fallback.

    seed = DhtSeed(cfg.p2p, run_id=cfg.run_id, store=shard_store).start()
    for signed in newest_manifests:             # at startup: what is still kept
        seed.publish(signed.manifest)
    run_info.dht_peers = seed.bootstrap_peers
    ...                                         # after each publish: seed.publish(manifest)
    seed.close()                                # on shutdown

For stable bootstrap addresses give the seed a fixed port and key, e.g. `host_maddrs =
["/ip4/0.0.0.0/tcp/31337"]`, `announce_maddrs = ["/ip4/<public address>/tcp/31337"]`, `identity_path =
"<data_dir>/p2p.key"`.
"""

from __future__ import annotations

import logging

from swarmrl.protocol.manifest import CheckpointManifest
from swarmrl.transfer.p2p.config import P2PConfig
from swarmrl.transfer.p2p.swarm import SwarmPeer
from swarmrl.transfer.store import ShardStore

log = logging.getLogger(__name__)


class DhtSeed:
    """Joins (or starts) the DHT as a bootstrap peer and serves `store` as a seed for published manifests."""

    def __init__(self, config: P2PConfig, run_id: str, store: ShardStore, keep_versions: int = 3):
        self.config = config.model_copy(update={"seed": True})
        self.store = store
        self.keep_versions = keep_versions
        self.peer = SwarmPeer(self.config, run_id)
        self._published: dict[int, CheckpointManifest] = {}

    def start(self) -> DhtSeed:
        self.peer.start()
        log.info("DHT seed %s listening on %s", self.peer.peer_id, ", ".join(self.peer.maddrs))
        return self

    def close(self) -> None:
        self.peer.close()

    def __enter__(self) -> DhtSeed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def bootstrap_peers(self) -> list[str]:
        """Multiaddrs for RunInfo.dht_peers: the announced ones if configured, else those the daemon sees.

        Wildcard addresses (0.0.0.0, ::) are left out: nobody can dial them.
        """
        out = [a for a in self.peer.maddrs if "/ip4/0.0.0.0/" not in a and "/ip6/::/" not in a]
        if self.config.announce_maddrs:
            announced = [a for a in out if any(a.startswith(m) for m in self.config.announce_maddrs)]
            out = announced or out
        return out

    def publish(self, manifest: CheckpointManifest) -> None:
        """Serve and announce `manifest` (its shards must be in the store); retire versions beyond keep_versions."""
        self._published[manifest.version] = manifest
        self.peer.serve(manifest, self.store)
        for v in sorted(self._published)[: -self.keep_versions]:
            self.peer.retire(self._published.pop(v))
