"""The swarm as CheckpointFetcher sees it: `SwarmSource` expands into one `PeerSource` per holder of a version.

    sources = [SwarmSource(peer), HttpOrigin(client)]

A holder flagged as a seed counts as one for the scheduler only if it is a bootstrap peer (the
coordinator's seed, from RunInfo.dht_peers): nobody else can claim the deference a seed gets. Failures feed
the peer's health: bad bytes ban the holder, other failures count against it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from swarmrl.protocol.manifest import CheckpointManifest, ShardRef
from swarmrl.transfer.p2p.dht import HolderRecord, manifest_info
from swarmrl.transfer.p2p.wire import PeerError
from swarmrl.transfer.sources import WAIT, ShardSource
from swarmrl.transfer.store import ShardStore

if TYPE_CHECKING:
    from swarmrl.transfer.p2p.swarm import SwarmPeer

WAIT_MEMO_S = 0.3  # a seed that said "wait" is not asked again for this long


class PeerSource(ShardSource):
    """One peer of the swarm, as the fetcher sees it (made by SwarmSource.expand)."""

    def __init__(self, peer: SwarmPeer, peer_id: str, record: HolderRecord):
        self.peer = peer
        self.peer_id = peer_id
        self._wait_until = 0.0
        self.update(record)

    def update(self, record: HolderRecord) -> None:
        self.record = record
        self.have = record.indices()
        self._have_shas: tuple[CheckpointManifest, frozenset[str]] | None = None  # `have` as hashes
        self.seed = record.seed and self.peer_id in self.peer.trusted_seeds
        self.name = f"{'seed' if self.seed else 'peer'}:{self.peer_id[-8:]}"

    @property
    def key(self) -> str:
        return f"peer:{self.peer_id}"

    def holds(self, manifest: CheckpointManifest, shard: ShardRef) -> bool:
        idx = _shard_index(manifest).get(shard.sha256, ())
        return any(i in self.have for i in idx)

    def held(self, manifest: CheckpointManifest, wanted: dict[str, ShardRef]) -> set[str]:
        if self._have_shas is None or self._have_shas[0] is not manifest:
            shards = manifest_info(manifest).shards
            self._have_shas = (manifest, frozenset(shards[i].sha256 for i in self.have if i < len(shards)))
        return set(self._have_shas[1].intersection(wanted))

    def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
        return self.peer.fetch(self.peer_id, shard)

    def suggest(self, manifest: CheckpointManifest, wanted: list[ShardRef]) -> ShardRef | object | None:
        if not self.seed:
            return None
        now = time.monotonic()
        if now < self._wait_until:  # asked a moment ago and told to wait: do not ask again yet
            return WAIT
        answer = self.peer.suggest(self.peer_id, manifest, wanted)
        if answer is WAIT:
            self._wait_until = now + WAIT_MEMO_S
        return answer

    def on_success(self, manifest: CheckpointManifest, shard: ShardRef) -> None:
        self.peer.forgive(self.peer_id)

    def on_failure(self, manifest: CheckpointManifest, shard: ShardRef, error: str, bad_bytes: bool) -> None:
        if bad_bytes:
            self.peer.ban(self.peer_id, f"shard {shard.sha256[:12]}: {error}")
        else:
            self.peer.strike(self.peer_id)


def _shard_index(manifest: CheckpointManifest) -> dict[str, tuple[int, ...]]:
    return manifest_info(manifest).index


class SwarmSource(ShardSource):
    """All peers of the swarm as one entry of CheckpointFetcher's sources (it expands into PeerSources)."""

    name = "swarm"
    seed = False

    def __init__(self, peer: SwarmPeer):
        self.peer = peer
        self._peers: dict[str, PeerSource] = {}

    def expand(self, manifest: CheckpointManifest) -> list[ShardSource]:
        out: list[ShardSource] = []
        for pid, rec in self.peer.holders(manifest).items():
            if not self.peer.usable(pid):
                continue
            src = self._peers.get(pid)
            if src is None:
                src = self._peers[pid] = PeerSource(self.peer, pid, rec)
            elif src.record != rec:
                src.update(rec)
            out.append(src)
        return out

    def holds(self, manifest: CheckpointManifest, shard: ShardRef) -> bool:
        return any(s.holds(manifest, shard) for s in self.expand(manifest))

    def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
        """Any holder's copy (for callers that do not expand sources); tries holders until one answers."""
        errors = []
        for src in self.expand(manifest):
            if src.holds(manifest, shard):
                try:
                    return src.get(manifest, shard)
                except Exception as e:  # noqa: BLE001
                    errors.append(f"{src.name}: {e}")
        raise PeerError("no peer delivered the shard: " + ("; ".join(errors) or "no holder known"))

    def prepare(self, manifest: CheckpointManifest, store: ShardStore) -> None:
        self.peer.serve(manifest, store)
        self.peer.holders(manifest, wait=True)

    def stored(self, manifest: CheckpointManifest, shard: ShardRef) -> None:
        self.peer.mark_held(manifest, shard)
