"""Checkpoints, in-process shard sources and a condition wait, shared by the checkpoint-transfer tests."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.manifest import CheckpointManifest, ShardRef, SignedManifest
from swarmrl.transfer.sources import ShardSource
from swarmrl.transfer.store import ShardStore, cut_checkpoint

SHARD = 64 * 1024


def make_checkpoint(root: Path, version: int = 1, size: int = 600_000, seed: int = 0) -> tuple[Path, bytes]:
    ckpt = root / f"ckpt-v{version}-{seed}"
    ckpt.mkdir(parents=True)
    weights = os.urandom(size)
    (ckpt / "model.safetensors").write_bytes(weights)
    (ckpt / "config.json").write_text(f'{{"version": {version}}}')
    return ckpt, weights


def publish(tmp_path: Path, coordinator: Identity) -> tuple[SignedManifest, ShardStore, bytes]:
    """A signed 600 kB checkpoint (10 shards of 64 KiB) and the origin's store holding its shards."""
    ckpt, weights = make_checkpoint(tmp_path)
    store = ShardStore(tmp_path / "origin")
    manifest = cut_checkpoint(ckpt, run_id="test", version=1, store=store, shard_size=SHARD)
    return SignedManifest.sign(manifest, coordinator), store, weights


class StoreSource(ShardSource):
    """A plain source reading a ShardStore (the HTTP origin without HTTP), recording what it was asked."""

    def __init__(self, store: ShardStore, name: str = "origin"):
        self.store = store
        self.name = name
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
        with self.lock:
            self.calls.append(shard.sha256)
        return self.store.get(shard.sha256)


class FakePeer(ShardSource):
    """A peer holding the shards in `holds`, reading them from `store`, logging (name, sha) per request."""

    seed = False

    def __init__(self, name: str, store: ShardStore, holds: set[str], log: list[tuple[str, str]]):
        self.name, self.store, self.have, self.log = name, store, holds, log

    def holds(self, manifest: CheckpointManifest, shard: ShardRef) -> bool:
        return shard.sha256 in self.have

    def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
        self.log.append((self.name, shard.sha256))
        return self.store.get(shard.sha256)


class LyingStore:
    """Claims every shard of a manifest and serves random bytes of the right size."""

    def __init__(self, manifest: CheckpointManifest):
        self.sizes = {s.sha256: s.size for s in manifest.shards()}
        self.served = 0

    def has(self, sha: str) -> bool:
        return sha in self.sizes

    def get(self, sha: str) -> bytes:
        self.served += 1
        return os.urandom(self.sizes[sha])


class GatedStore(ShardStore):
    """A real store whose reads wait for `gate` (a peer that is slow for as long as the test wants); `reading`
    is set when a read has begun."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.gate = threading.Event()
        self.reading = threading.Event()

    def get(self, sha256: str) -> bytes:
        self.reading.set()
        self.gate.wait(120)
        return super().get(sha256)
