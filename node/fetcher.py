"""Fetching signed checkpoints: manifest first, then every shard hash-checked, then the files assembled.

Nothing is loaded before the manifest's signature has been checked against the coordinator's pinned key
and found newer than what the node holds. Shards come from `ShardSource`s tried in order (peers first
when there are any, the coordinator's HTTP origin as seed and fallback); a source that returns bytes
that do not match their hash is reported through `on_bad_shard`, and the shard is taken elsewhere.
Shards already on disk are reused, so a killed download resumes where it stopped.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from protocol.client import CoordinatorClient
from protocol.manifest import (
    CheckpointManifest,
    ManifestError,
    ShardRef,
    ShardStore,
    SignedManifest,
    assemble_checkpoint,
    sha256_bytes,
)


class ShardSource(ABC):
    """Somewhere shards can be read from. Implementations may be slow, fail, or lie about bytes."""

    name: str = "source"

    @abstractmethod
    def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
        """The bytes of `shard` (not yet verified: the caller checks the hash). Raises on failure."""


class HttpOrigin(ShardSource):
    """The coordinator's HTTP origin."""

    name = "origin"

    def __init__(self, client: CoordinatorClient):
        self.client = client

    def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
        return self.client.shard(shard.sha256)


@dataclass
class FetchStats:
    shards_fetched: int = 0
    shards_reused: int = 0
    bytes_fetched: int = 0
    bad_shards: int = 0
    by_source: dict[str, int] = field(default_factory=dict)


class CheckpointFetcher:
    """Keeps verified checkpoint versions under `root`/v{version}, at most `keep_versions` of them."""

    def __init__(self, root: str | Path, coordinator_key: str, sources: list[ShardSource], keep_versions: int = 2,
                 on_bad_shard: Callable[[ShardSource, ShardRef], None] | None = None):
        self.root = Path(root)
        self.store = ShardStore(self.root / "shards")
        self.coordinator_key = coordinator_key
        self.sources = sources
        self.keep_versions = keep_versions
        self.on_bad_shard = on_bad_shard
        self.stats = FetchStats()
        self._manifests: dict[int, CheckpointManifest] = {}

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def accept_manifest(self, signed: SignedManifest, held_version: int) -> CheckpointManifest:
        """The manifest if correctly signed by the coordinator and newer than `held_version`, else ManifestError."""
        return signed.verify(self.coordinator_key, newer_than=held_version)

    def fetch(self, signed: SignedManifest, held_version: int = -1) -> tuple[CheckpointManifest, Path]:
        """Verify `signed`, fetch its missing shards, assemble and check every file. Returns its directory."""
        manifest = self.accept_manifest(signed, held_version)
        out = self.version_dir(manifest.version)
        if not out.exists():
            for shard in manifest.shards():
                self._ensure(manifest, shard)
            assemble_checkpoint(manifest, self.store.get, out)
        (self.root / "manifests").mkdir(parents=True, exist_ok=True)
        (self.root / "manifests" / f"{manifest.version:08d}.json").write_text(signed.model_dump_json())
        self._manifests[manifest.version] = manifest
        self._prune()
        return manifest, out

    def _ensure(self, manifest: CheckpointManifest, shard: ShardRef) -> None:
        if self.store.has(shard.sha256):
            self.stats.shards_reused += 1
            return
        errors: list[str] = []
        for source in self.sources:
            try:
                data = source.get(manifest, shard)
            except Exception as e:  # a failing source is skipped, never fatal: another may have it
                errors.append(f"{source.name}: {e}")
                continue
            if len(data) != shard.size or sha256_bytes(data) != shard.sha256:
                self.stats.bad_shards += 1
                errors.append(f"{source.name}: bad bytes")
                if self.on_bad_shard is not None:
                    self.on_bad_shard(source, shard)
                continue
            self.store.put(shard.sha256, data)
            self.stats.shards_fetched += 1
            self.stats.bytes_fetched += len(data)
            self.stats.by_source[source.name] = self.stats.by_source.get(source.name, 0) + 1
            return
        raise ManifestError(f"no source had a good copy of shard {shard.sha256[:12]}: {'; '.join(errors)}")

    def _prune(self) -> None:
        versions = sorted(int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit())
        for v in versions[: -self.keep_versions]:
            shutil.rmtree(self.version_dir(v), ignore_errors=True)
            (self.root / "manifests" / f"{v:08d}.json").unlink(missing_ok=True)
            self._manifests.pop(v, None)
        keep = []
        for p in sorted((self.root / "manifests").glob("*.json")):
            try:
                keep.append(SignedManifest.model_validate_json(p.read_text()).manifest)
            except ValueError:
                p.unlink(missing_ok=True)
        if keep:
            self.store.remove_unreferenced(keep)
