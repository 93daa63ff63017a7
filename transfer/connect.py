"""How a role that fetches checkpoints (a node, a verifier) sets up its fetcher for a pool: the coordinator's
HTTP origin, and the swarm when the pool has one and the role's `[p2p]` allows it.

    fetcher, swarm = open_fetcher(root, key, client, run_info, p2p=cfg.p2p, fetch=cfg.fetch, keep_versions=2)
    ...
    if swarm is not None:
        swarm.close()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

from swarmrl.protocol.run import RunInfo
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.transfer.fetcher import CheckpointFetcher, FetchConfig
from swarmrl.transfer.p2p.config import P2PConfig
from swarmrl.transfer.sources import HttpOrigin, ShardSource

if TYPE_CHECKING:
    from swarmrl.transfer.p2p.swarm import SwarmPeer

log = logging.getLogger(__name__)


def open_fetcher(root: str | Path, coordinator_key: str, client: CoordinatorClient, run: RunInfo | None, *,
                 p2p: P2PConfig | None, fetch: FetchConfig | None = None, keep_versions: int = 2,
                 extra_sources: list[ShardSource] | None = None,
                 in_use: Callable[[], Collection[int]] = frozenset) -> tuple[CheckpointFetcher, SwarmPeer | None]:
    """A fetcher over `extra_sources`, the swarm and the HTTP origin (the fallback), and the started swarm peer
    (the caller closes it), or None. The swarm is joined when `p2p` is given and enabled and there are bootstrap
    peers (`p2p.initial_peers`, else the pool's `run.dht_peers`; `run` is needed then); if its daemon or DHT
    cannot start, the fetcher works from the origin alone. `in_use` names versions never pruned (CheckpointFetcher)."""
    sources: list[ShardSource] = list(extra_sources or [])
    swarm = None
    if p2p is not None and p2p.enabled:
        if run is None:
            raise ValueError("joining the checkpoint swarm needs the pool's RunInfo")
        if p2p.initial_peers or run.dht_peers:
            # hivemind starts a libp2p daemon and imports torch: only when the pool has a swarm
            from swarmrl.transfer.p2p import start_swarm
            from swarmrl.transfer.p2p.sources import SwarmSource

            swarm = start_swarm(p2p, run.run_id, run.dht_peers)
            if swarm is not None:
                sources.append(SwarmSource(swarm))
                log.info("joined the checkpoint swarm as %s", swarm.peer_id)
    sources.append(HttpOrigin(client))
    return CheckpointFetcher(root, coordinator_key, sources, keep_versions=keep_versions, config=fetch,
                             in_use=in_use, manifests=client.manifest), swarm
