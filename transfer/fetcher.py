"""Fetching signed checkpoints: manifest first, then every shard hash-checked and written into its files.

Nothing is fetched before the manifest's signature has been checked against the coordinator's pinned key.
Which version to fetch is the caller's choice: a node fetches only versions newer than the one it holds, a
verifier also older ones. Shards come from `ShardSource`s (the HTTP origin, the libp2p swarm), scheduled by
`transfer.schedule` under the knobs of `FetchConfig` and fetched by `transfer.download`; a source that returns
bytes that do not match their hash is reported through `on_bad_shard` (and its own `on_failure`), and the shard
is taken elsewhere. Shards already on disk are reused, so a killed download resumes where it stopped.

A delta checkpoint's files (its payloads among them) are fetched exactly like a full one's, then its weights files
are rebuilt from the base version held here and checked against the signed tensor hashes (`transfer.delta`). A
receiver that does not hold the base (it missed versions) fetches the base first, by the base's own manifest
(`manifests`), and so on back to a version it holds or to the full checkpoint the chain starts from.

    fetcher = CheckpointFetcher(root, coordinator_key, [SwarmSource(peer), HttpOrigin(client)], config=cfg.fetch)
    manifest, path = fetcher.fetch(signed)   # path: root/v{version:08d}, complete or absent
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Collection
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from swarmrl.protocol.manifest import CheckpointManifest, ManifestError, ShardRef, SignedManifest, sha256_bytes
from swarmrl.transfer.delta import rebuild
from swarmrl.transfer.download import Download, FetchStats, ShardUnavailable
from swarmrl.transfer.sources import ShardSource
from swarmrl.transfer.store import CheckpointAssembly, ShardStore

log = logging.getLogger(__name__)

__all__ = ["CheckpointFetcher", "FetchConfig", "FetchStats", "ShardUnavailable"]


class FetchConfig(BaseModel):
    """How a node (or verifier) schedules the shards of a checkpoint over its sources (one `[fetch]` table).

    With the swarm, the fetcher runs `max_parallel_peers * requests_per_peer + origin_parallel` worker
    threads; with seeds only (the HTTP origin), `origin_parallel`: one shard after another by default.
    """

    model_config = ConfigDict(extra="forbid")

    max_parallel_peers: int = Field(
        7, ge=1, description="Peers downloaded from at once (see requests_per_peer for the requests to each): "
        "enough streams to fill a node's download link while each holder splits its upload among its "
        "p2p.max_uploads askers (bench/RESULTS.md)."
    )
    requests_per_peer: int = Field(
        1, ge=1, description="Shard requests kept open to one peer. 2 pipelines them: the peer serves a node's "
        "requests one after another in one upload slot, so the next starts without a round trip when the current "
        "one ends. The peer counts once against max_parallel_peers."
    )
    origin_parallel: int = Field(
        1, ge=1, description="Shards downloaded at once from each seed (the coordinator's seed peer, the HTTP "
        "origin)."
    )
    spread_holders: bool = Field(
        True, description="Choose the peer first (the free one least used by this download), then the rarest shard "
        "it holds. False: the rarest shard first, then a free holder of it, which sends every node to the few "
        "holders of the newest shards while other holders' uplinks idle."
    )
    endgame: bool = Field(
        True, description="Once every missing shard is in flight, ask a second holder for shards still in flight; "
        "the first copy wins (BitTorrent's end game), so one slow holder cannot hold up the checkpoint."
    )
    endgame_patience: float = Field(
        2.0, ge=0, description="The end game asks a second holder only for a download that has taken this many "
        "times the median download so far; 0: for every shard in flight (which loads the few holders of the "
        "newest shards, and the seed, with copies nobody needs)."
    )
    stall_timeout_s: float = Field(
        120.0, gt=0, description="Without any seed source, give up when no shard has arrived for this long and "
        "nothing is in flight (with seeds, a shard fails once every seed has failed it)."
    )
    poll_s: float = Field(
        0.2, gt=0, description="A worker with nothing to start looks again after this long (or when a request ends)."
    )
    max_delta_chain: int = Field(
        256, ge=1, description="Most delta checkpoints fetched in a row to reach a version from one held here (or "
        "from the full checkpoint the chain starts at). The trainer's full_every keeps honest chains shorter; a "
        "longer one is refused."
    )


class CheckpointFetcher:
    """Keeps verified checkpoint versions under `root`/v{version:08d}, at most `keep_versions` of them (the most
    recently fetched), with their shards in `root`/shards and their signed manifests in `root`/manifests. Versions
    that `in_use()` names (a node's loaded weights, the ones it is about to load) are never pruned: they may take the
    disk above `keep_versions` for as long as they are in use."""

    def __init__(self, root: str | Path, coordinator_key: str, sources: list[ShardSource], keep_versions: int = 2,
                 on_bad_shard: Callable[[ShardSource, ShardRef], None] | None = None, *,
                 config: FetchConfig | None = None, in_use: Callable[[], Collection[int]] = frozenset,
                 manifests: Callable[[int], SignedManifest | None] | None = None):
        self.root = Path(root)
        # Where the signed manifest of a delta's base version comes from (the coordinator's GET /v1/manifest/{v}).
        self.manifests = manifests
        self.store = ShardStore(self.root / "shards")
        self.coordinator_key = coordinator_key
        self.sources = sources
        self.keep_versions = keep_versions
        self.on_bad_shard = on_bad_shard
        self.in_use = in_use
        self.config = config or FetchConfig()
        self.stats = FetchStats()
        self._fetched: list[int] = []  # versions fetched by this process, the most recent last

    @property
    def workers(self) -> int:
        """Worker threads per download: request slots for peers (if any source stands for peers) and seeds."""
        cfg = self.config
        peers = any(not s.seed for s in self.sources)
        seeds = any(s.seed for s in self.sources)
        return max(1, peers * cfg.max_parallel_peers * cfg.requests_per_peer + seeds * cfg.origin_parallel)

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def verify(self, signed: SignedManifest) -> CheckpointManifest:
        """The manifest if correctly signed by the coordinator, else ManifestError."""
        return signed.verify(self.coordinator_key)

    def fetch(self, signed: SignedManifest, *, _chain: int = 0) -> tuple[CheckpointManifest, Path]:
        """Verify `signed`, fetch its missing shards into the store and, as each arrives, into the checkpoint's
        files (CheckpointAssembly); a delta is then rebuilt into the full checkpoint and checked (module
        docstring). Returns the checkpoint's directory. Any version may be fetched, older ones too; a version
        already held is returned as it is."""
        manifest = self.verify(signed)
        out = self.version_dir(manifest.version)
        if not out.exists():
            if manifest.delta is None:
                self._assemble(manifest, out)
            else:
                self._fetch_delta(manifest, out, _chain)
        (self.root / "manifests").mkdir(parents=True, exist_ok=True)
        self._manifest_path(manifest.version).write_text(signed.model_dump_json())
        if manifest.version in self._fetched:
            self._fetched.remove(manifest.version)
        self._fetched.append(manifest.version)
        self._prune()
        return manifest, out

    def _assemble(self, manifest: CheckpointManifest, out: Path) -> None:
        assembly = CheckpointAssembly(manifest, out)  # shards go into the files as they arrive
        try:
            missing = self._reuse(manifest, assembly)
            for source in self.sources:
                source.prepare(manifest, self.store)
            if missing:
                Download(manifest, missing, assembly, self.store, self.sources, self.config, self.config.poll_s,
                         self.workers, self.stats, self.on_bad_shard).run()
            assembly.finish()
        except BaseException:
            assembly.abort()
            raise

    def _fetch_delta(self, manifest: CheckpointManifest, out: Path, chain: int) -> None:
        assert manifest.delta is not None
        base = manifest.delta.base_version
        if not self.version_dir(base).exists():  # versions missed: the base first, by its own chain
            if chain + 1 >= self.config.max_delta_chain:
                raise ManifestError(f"more than {self.config.max_delta_chain} deltas in a row (max_delta_chain)")
            signed_base = self.manifests(base) if self.manifests is not None else None
            if signed_base is None:
                raise ShardUnavailable(f"version {manifest.version} is a delta of version {base}, which is not "
                                       "held here and whose manifest the coordinator no longer has")
            if signed_base.manifest.version != base:
                raise ManifestError(f"asked for the manifest of version {base}, got {signed_base.manifest.version}")
            self.fetch(signed_base, _chain=chain + 1)
        # The files as listed (payloads included) go through the same download, then are rebuilt beside `out`.
        staged = self.root / f".delta-{out.name}"
        shutil.rmtree(staged, ignore_errors=True)  # what a killed rebuild left
        self._assemble(manifest, staged)
        rebuild(self.version_dir(base), staged, manifest.delta, out)

    def remove(self, version: int) -> None:
        """Delete `version`'s files and manifest, and the shards no version still held needs."""
        self._drop(version)
        self._remove_unreferenced()

    def _manifest_path(self, version: int) -> Path:
        return self.root / "manifests" / f"{version:08d}.json"

    def _reuse(self, manifest: CheckpointManifest, assembly: CheckpointAssembly) -> list[ShardRef]:
        """Write the shards already on disk (a resumed download, or shards shared with another version) into
        `assembly`, checking their hashes again; returns the shards to fetch. A damaged one is deleted and
        fetched again, before anything is served from the store."""
        missing = []
        for ref in manifest.shards():
            if not self.store.has(ref.sha256):
                missing.append(ref)
                continue
            try:  # only reading and checking the stored copy: a failure to write the files is no damage
                data = self.store.get(ref.sha256)
                if sha256_bytes(data) != ref.sha256:
                    raise ManifestError("its hash does not match")
            except (ManifestError, OSError) as e:
                log.warning("stored shard %s is damaged (%s); fetching it again", ref.sha256[:12], e)
                self.store.path(ref.sha256).unlink(missing_ok=True)
                missing.append(ref)
                continue
            assembly.write(ref.sha256, data, verified=True)
            self.stats.shards_reused += 1
        return missing

    def _prune(self) -> None:
        """Keep the `keep_versions` most recently fetched versions: those fetched by this process, newest fetch
        last, come after any left on disk by an earlier one (ordered by when their manifest was written), and those
        in use."""
        in_use = set(self.in_use())
        versions = [int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit()]

        def recency(v: int) -> tuple[int, int, int]:
            if v in self._fetched:
                return (1, self._fetched.index(v), v)
            try:
                return (0, self._manifest_path(v).stat().st_mtime_ns, v)
            except OSError:
                return (0, -1, v)

        for v in sorted(versions, key=recency)[: -self.keep_versions]:
            if v not in in_use:
                self._drop(v)
        self._remove_unreferenced()

    def _drop(self, version: int) -> None:
        shutil.rmtree(self.version_dir(version), ignore_errors=True)
        self._manifest_path(version).unlink(missing_ok=True)
        if version in self._fetched:
            self._fetched.remove(version)

    def _remove_unreferenced(self) -> None:
        keep = []
        for p in sorted((self.root / "manifests").glob("*.json")):
            try:
                keep.append(SignedManifest.model_validate_json(p.read_text()).manifest)
            except ValueError:
                p.unlink(missing_ok=True)
        if keep:
            self.store.remove_unreferenced(keep)
