"""Checkpoints: shard uploads, publishing signed manifests (the current policy version), serving both.

The trainer uploads a version's content-addressed shards, then publishes its manifest; the coordinator signs it
and it becomes the current version, which every lease and staleness check is measured against. Shards live in
`ShardStore` (files, written atomically), manifests and the current version in the database. Publish hooks
(e.g. the DHT seed) run in the process that handled the publish.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import select

from swarmrl.coordinator.auth import Refused, Signed
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.schema import CURRENT_VERSION, manifests, rollout_groups
from swarmrl.coordinator.db.store import Store, Tx, counter, insert, raise_counter
from swarmrl.coordinator.gate import admit
from swarmrl.coordinator.idempotency import Answered, previous_answer, remember
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.manifest import CheckpointManifest, ManifestError, SignedManifest
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.transfer.store import ShardStore

log = logging.getLogger("swarmrl.coordinator")


def current_version(tx: Tx) -> int:
    """The newest published policy version; -1 before the first."""
    return counter(tx, CURRENT_VERSION)


def get_manifest(tx: Tx, version: int) -> SignedManifest | None:
    row = tx.execute(select(manifests.c.signed).where(manifests.c.version == version)).first()
    return SignedManifest.model_validate(row.signed) if row is not None else None


def latest_manifests(tx: Tx, n: int) -> list[SignedManifest]:
    """The `n` newest manifests, newest first."""
    rows = tx.execute(select(manifests.c.signed).order_by(manifests.c.version.desc()).limit(n))
    return [SignedManifest.model_validate(r.signed) for r in rows]


def manifests_to_keep(tx: Tx, newest: int) -> list[SignedManifest]:
    """The manifests whose shards must stay: the `newest` ones, those of every version a pending group was
    generated with, which its verifier must still load however far the trainer has moved on meanwhile (a group
    submitted within the staleness bound is checked, whatever the verifiers' lag), and the bases of every delta
    kept, back to a full checkpoint."""
    pending = select(rollout_groups.c.policy_version).where(rollout_groups.c.status == "pending").distinct()
    rows = tx.execute(select(manifests.c.signed).where(manifests.c.version.in_(pending)))
    keep = {s.manifest.version: s for s in latest_manifests(tx, newest)}
    for r in rows:
        signed = SignedManifest.model_validate(r.signed)
        keep.setdefault(signed.manifest.version, signed)
    # A delta is of no use without its base: every kept delta keeps its chain back to the full checkpoint it starts
    # from (at most the trainer's full_every versions), which is also what a node that missed versions fetches.
    bases = [s.manifest.delta.base_version for s in keep.values() if s.manifest.delta is not None]
    while bases:
        version = bases.pop()
        if version in keep or (base := get_manifest(tx, version)) is None:
            continue
        keep[version] = base
        if base.manifest.delta is not None:
            bases.append(base.manifest.delta.base_version)
    return list(keep.values())


def is_sha256(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


class Checkpoints:
    """Shards and manifests of one run, signed with the coordinator's `identity`."""

    def __init__(self, store: Store, shards: ShardStore, config: CoordinatorConfig, identity: Identity,
                 clock: Callable[[], float]):
        self.store, self.shards, self.config, self.identity, self.clock = store, shards, config, identity, clock
        # Called with each newly published manifest (e.g. the DHT seed starts serving it).
        self.publish_hooks: list[Callable[[CheckpointManifest], None]] = []
        self._publish_lock = threading.Lock()

    def current_version(self) -> int:
        return self.store.read(current_version)

    def manifest(self, version: int | None = None) -> SignedManifest | None:
        """The manifest of `version` (default: the newest), or None."""
        if version is None:
            newest = self.store.read(lambda tx: latest_manifests(tx, 1))
            return newest[0] if newest else None
        return self.store.read(lambda tx: get_manifest(tx, version))

    def put_shard(self, sha256: str, data: bytes) -> None:
        """Store an authenticated shard upload (its digest was checked against the signed one, which is `sha256`)."""
        try:
            self.shards.put(sha256, data)
        except ManifestError as e:
            raise Refused(RefusalCode.INVALID_MANIFEST, str(e)) from None

    def shard_path(self, sha256: str) -> Path:
        """Where the shard `sha256` is stored; Refused(400) for a malformed hash, Refused(404) if absent."""
        if not is_sha256(sha256):
            raise Refused(RefusalCode.NOT_SHA256, "not a sha256")
        path = self.shards.path(sha256)
        if not path.is_file():
            raise Refused(RefusalCode.NO_SUCH_SHARD, "no such shard")
        return path

    def publish(self, req: Signed) -> SignedManifest:
        """Sign and publish a manifest whose shards are all here; it becomes the current version."""
        manifest: CheckpointManifest = req.payload.manifest
        earlier = self.store.read(lambda tx: previous_answer(tx, req))
        if earlier is not None:  # a retry of a publish that was applied: before the checks, which it now fails
            raise Answered(earlier)
        if manifest.run_id != self.config.run.run_id:
            raise Refused(RefusalCode.WRONG_RUN,
                          f"manifest is for run {manifest.run_id!r}, this run is {self.config.run.run_id!r}")
        with self._publish_lock:  # one publish (and its shard collection) at a time in this process
            self._refuse_old(manifest.version, self.current_version())
            for f in manifest.files:
                if sum(s.size for s in f.shards) != f.size:
                    raise Refused(RefusalCode.INVALID_MANIFEST, f"file {f.path}: shard sizes do not add up to its size")
            for ref in manifest.shards():
                path = self.shards.path(ref.sha256)
                if not path.is_file():
                    raise Refused(RefusalCode.SHARD_MISSING, f"shard {ref.sha256} is missing: upload it first")
                if path.stat().st_size != ref.size:
                    raise Refused(RefusalCode.SHARD_MISSING,
                                  f"shard {ref.sha256} has {path.stat().st_size} bytes, manifest says {ref.size}")
            if manifest.delta is not None and self.manifest(manifest.delta.base_version) is None:
                raise Refused(RefusalCode.INVALID_MANIFEST,
                              f"a delta of version {manifest.delta.base_version}, which is not published here")
            now = self.clock()
            signed = SignedManifest.sign(manifest.model_copy(update={"created_at": now}), self.identity)

            def commit(tx: Tx) -> list[SignedManifest]:
                admit(tx, req)
                # Locked: publishes through other coordinator processes wait, so versions only ever increase.
                self._refuse_old(manifest.version, counter(tx, CURRENT_VERSION, lock=True))
                tx.execute(insert(tx, manifests).values(version=manifest.version, signed=signed.model_dump(mode="json"),
                                                        published_at=now))
                raise_counter(tx, CURRENT_VERSION, manifest.version)
                remember(tx, req, signed, now)
                return manifests_to_keep(tx, self.config.keep_versions)

            keep = self.store.write(commit)
            # Shards are collected only here, right after a publish: a single trainer uploads the shards of
            # version v+1 after publishing v, so nothing it still needs is removed.
            self.shards.remove_unreferenced([s.manifest for s in keep])
        for hook in self.publish_hooks:
            try:
                hook(signed.manifest)
            except Exception:  # a failing side channel must not undo a publish: nodes still have the origin
                log.exception("publish hook failed for version %d", manifest.version)
        return signed

    @staticmethod
    def _refuse_old(version: int, current: int) -> None:
        if version <= current:
            raise Refused(RefusalCode.VERSION_NOT_NEWER,
                          f"version {version} is not newer than the current version {current}")
