"""Fetching signed checkpoints: manifest first, then every shard hash-checked and written into its files.

Nothing is loaded before the manifest's signature has been checked against the coordinator's pinned key
and found newer than what the node holds. Shards come from `ShardSource`s; a source that returns bytes
that do not match their hash is reported through `on_bad_shard` (and its own `on_failure`), and the shard
is taken elsewhere. Shards already on disk are reused, so a killed download resumes where it stopped.

Scheduling. A source may stand for several concrete sources (`expand`: the swarm expands into one source
per peer that the DHT says holds shards of this version) and may hold only some shards (`holds`). Sources
with `seed = True` (the HTTP origin, the coordinator's seed peer: holders of everything, but one shared
link) are used for shards that no peer holds, rarest first; peers are used for every shard they hold,
rarest first (fewest peer holders), ties broken by a per-fetch rotation of the shard list so that nodes
starting together take different shards from the seed; with `spread_holders` the peer is chosen first.
Up to `max_parallel` shards are in flight, at most `max_in_flight` to any one source. With the defaults
(`max_parallel=1`, plain sources) this is the original behaviour: shard after shard, sources tried in the
order given.
"""

from __future__ import annotations

import logging
import random
import shutil
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from swarmrl.protocol.manifest import CheckpointManifest, ManifestError, ShardRef, SignedManifest, sha256_bytes
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.transfer.sources import WAIT, BadShardBytes, ShardSource, SourceBusy
from swarmrl.transfer.store import CheckpointAssembly, ShardStore

log = logging.getLogger(__name__)


class HttpOrigin(ShardSource):
    """The coordinator's HTTP origin."""

    name = "origin"

    def __init__(self, client: CoordinatorClient, max_in_flight: int = 1):
        self.client = client
        self.max_in_flight = max_in_flight

    def get(self, manifest: CheckpointManifest, shard: ShardRef) -> bytes:
        return self.client.shard(shard.sha256)


@dataclass
class FetchStats:
    shards_fetched: int = 0
    shards_reused: int = 0
    bytes_fetched: int = 0
    bad_shards: int = 0
    failures: int = 0
    busy: int = 0
    duplicates: int = 0  # end-game requests for a shard already in flight from another source
    late_copies: int = 0  # end-game copies that arrived after the shard was stored (bytes_fetched counts them)
    idle_s: float = 0.0  # worker-seconds spent waiting for a shard and a source with room for it
    by_source: dict[str, int] = field(default_factory=dict)


class CheckpointFetcher:
    """Keeps verified checkpoint versions under `root`/v{version}, at most `keep_versions` of them.

    `max_parallel`: shards in flight at once (from different sources, or several to a source whose
    `max_in_flight` allows it: the next request then waits at the source and starts without a round trip);
    at most `max_peer_parallel` non-seed sources are asked at once, so that the rest stay free for the seeds.
    `stall_timeout_s`: give up when no source can make progress for this long (only when no seed source is
    configured; with seeds a shard fails once every seed failed it).
    `endgame`: once every missing shard is in flight, idle workers ask a second free source for a shard
    still in flight (at most two requests per shard); the first copy to arrive wins and `fetch` returns
    without waiting for the other, so one slow holder cannot hold up the last shards. Only a download that
    has taken `endgame_patience` times the median of this fetch's downloads so far is doubled (or 2 s before
    any has ended; 0: every one at once): doubling every last shard loaded the few holders of the newest
    shards, and the seed, with copies nobody needed (N=8 at 100 Mbit/s: 20.3-20.5 s without the end game,
    20.6-21.2 s with it doubling everything).
    `spread_holders`: pick the peer first (the free one this fetch uses least, at random among equals), then
    the rarest shard it holds, rather than the rarest shard first and then a free peer holding it. Rarest
    first sends every asker to the few holders of the newest shards while other holders' uplinks idle; this
    spreads the asks over all holders and keeps rarest first within each.
    """

    def __init__(self, root: str | Path, coordinator_key: str, sources: list[ShardSource], keep_versions: int = 2,
                 on_bad_shard: Callable[[ShardSource, ShardRef], None] | None = None, *, max_parallel: int = 1,
                 max_peer_parallel: int | None = None, poll_s: float = 0.2, stall_timeout_s: float = 120.0,
                 endgame: bool = True, endgame_patience: float = 2.0, spread_holders: bool = False):
        self.root = Path(root)
        self.store = ShardStore(self.root / "shards")
        self.coordinator_key = coordinator_key
        self.sources = sources
        self.keep_versions = keep_versions
        self.on_bad_shard = on_bad_shard
        self.max_parallel = max(1, max_parallel)
        self.max_peer_parallel = self.max_parallel if max_peer_parallel is None else max(1, max_peer_parallel)
        self.poll_s = poll_s
        self.stall_timeout_s = stall_timeout_s
        self.endgame = endgame
        self.endgame_patience = endgame_patience
        self.spread_holders = spread_holders
        self.stats = FetchStats()
        self._manifests: dict[int, CheckpointManifest] = {}

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def accept_manifest(self, signed: SignedManifest, held_version: int) -> CheckpointManifest:
        """The manifest if correctly signed by the coordinator and newer than `held_version`, else ManifestError."""
        return signed.verify(self.coordinator_key, newer_than=held_version)

    def fetch(self, signed: SignedManifest, held_version: int = -1) -> tuple[CheckpointManifest, Path]:
        """Verify `signed`, fetch its missing shards into the store and, as each arrives, into the checkpoint's
        files (CheckpointAssembly). Returns the checkpoint's directory."""
        manifest = self.accept_manifest(signed, held_version)
        out = self.version_dir(manifest.version)
        if not out.exists():
            assembly = CheckpointAssembly(manifest, out)  # shards go into the files as they arrive
            try:
                missing = self._reuse(manifest, assembly)
                for source in self.sources:
                    source.prepare(manifest, self.store)
                if missing:
                    _Download(self, manifest, missing, assembly).run()
                assembly.finish()
            except BaseException:
                assembly.abort()
                raise
        (self.root / "manifests").mkdir(parents=True, exist_ok=True)
        (self.root / "manifests" / f"{manifest.version:08d}.json").write_text(signed.model_dump_json())
        self._manifests[manifest.version] = manifest
        self._prune()
        return manifest, out

    def _reuse(self, manifest: CheckpointManifest, assembly: CheckpointAssembly) -> list[ShardRef]:
        """Write the shards already on disk (a resumed download, or shards shared with an older version) into
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


class _Download:
    """The missing shards of one manifest, fetched by `max_parallel` worker threads."""

    def __init__(self, fetcher: CheckpointFetcher, manifest: CheckpointManifest, missing: list[ShardRef],
                 assembly: CheckpointAssembly):
        self.f = fetcher
        self.manifest = manifest
        self.assembly = assembly
        # Rotation: every fetch starts at its own random place in the shard list (see the module docstring).
        k = random.randrange(len(missing)) if fetcher.max_parallel > 1 else 0
        order = missing[k:] + missing[:k]
        self.pending: dict[str, ShardRef] = {s.sha256: s for s in order}  # not stored nor in flight, in rank order
        self.refs: dict[str, ShardRef] = {s.sha256: s for s in missing}
        self.remaining: set[str] = set(self.refs)  # not yet stored
        self.in_flight: dict[str, set[str]] = {}  # shard sha -> keys of the sources fetching it now
        self.started: dict[str, float] = {}  # shard sha in flight -> when its first request now running began
        self.durations: deque[float] = deque(maxlen=64)  # seconds each of the last successful downloads took
        self.failed: dict[str, set[str]] = {}  # shard sha -> keys of sources that failed it
        self.errors: dict[str, list[str]] = {}
        self.load: dict[str, int] = {}
        self.peer_in_flight = 0  # non-seed sources with a download in flight
        self.busy_until: dict[str, float] = {}  # source key -> monotonic time it said it would be free again
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.last_progress = time.monotonic()

    def run(self) -> None:
        n = min(self.f.max_parallel, len(self.pending))
        if n == 1:
            self._work()
        else:
            threads = [threading.Thread(target=self._work, name=f"fetch-{i}", daemon=True) for i in range(n)]
            for t in threads:
                t.start()
            # Done when every shard is stored: an end-game duplicate still downloading finishes in the
            # background (its copy is stored or dropped like any other) instead of holding up the checkpoint.
            with self.cond:
                while self.remaining and self.error is None and any(t.is_alive() for t in threads):
                    self.cond.wait(0.5)
        if self.error is not None:
            raise self.error

    # -- choosing what to fetch from where -------------------------------------------------------------

    def _sources(self) -> list[ShardSource]:
        out: list[ShardSource] = []
        for top in self.f.sources:
            try:
                out.extend(top.expand(self.manifest))
            except Exception:  # noqa: BLE001 (discovery trouble must not stop the seeds)
                continue
        return out

    def _free(self, s: ShardSource) -> bool:
        return self.load.get(s.key, 0) < s.max_in_flight and self.busy_until.get(s.key, 0.0) <= time.monotonic()

    def _pick(self) -> tuple[ShardRef, ShardSource] | None:
        if not self.pending:
            return self._pick_duplicate() if self.f.endgame else None
        sources = self._sources()
        peers = [s for s in sources if not s.seed]
        seeds = [s for s in sources if s.seed]
        rank = {sha: r for r, sha in enumerate(self.pending)}
        # Who holds which pending shard, one set operation per peer (this runs for every pick: with 1 MiB
        # shards, asking every peer about every shard took a sixth of a node's CPU).
        held: dict[str, set[str]] = {}
        counts: dict[str, int] = dict.fromkeys(self.pending, 0)
        for p in peers:
            hs = held[p.key] = {sha for sha in p.held(self.manifest, self.pending)
                                if p.key not in self.failed.get(sha, ())}
            for sha in hs:
                counts[sha] += 1
        per_peer: list[tuple[tuple[int, int], str, ShardSource]] = []  # each free peer's rarest shard
        peer_room = self.peer_in_flight < self.f.max_peer_parallel
        for p in peers:
            if held[p.key] and self._free(p) and (peer_room or self.load.get(p.key, 0)):
                sha = min(held[p.key], key=lambda h: (counts[h], rank[h]))
                per_peer.append(((counts[sha], rank[sha]), sha, p))
        if per_peer:
            # Rarest first: the rarest shard, from its least-used free holder. Spread: the least-used free
            # peer, and its rarest shard.
            spread = self.f.spread_holders
            _, sha, pick = min(per_peer, key=lambda b: (
                () if spread else b[0], self.load.get(b[2].key, 0), random.random()))
            return self.pending[sha], pick
        # Seeds: each shard goes to the first seed (in the order given) that has not failed it; the next
        # seed is a fallback, not extra capacity (the HTTP origin and the seed peer share one link).
        queues: dict[str, tuple[ShardSource, list[ShardRef], int]] = {}
        for sha in sorted(self.pending, key=lambda h: (counts[h], rank[h])):
            shard = self.pending[sha]
            failed = self.failed.get(sha, ())
            first = next((s for s in seeds if s.key not in failed and s.holds(self.manifest, shard)), None)
            if first is None:
                if seeds and counts[sha] == 0:
                    raise ManifestError(f"no source had a good copy of shard {sha[:12]}: "
                                        f"{'; '.join(self.errors.get(sha, []))}")
                continue
            seed, queue, rarest = queues.setdefault(first.key, (first, [], counts[sha]))
            if counts[sha] == rarest:
                queue.append(shard)
        for seed, queue, _ in queues.values():
            if self._free(seed):
                hint = seed.suggest(self.manifest, queue)
                if hint is WAIT:
                    continue
                return (hint if isinstance(hint, ShardRef) and hint in queue else queue[0]), seed
        if not seeds and not self.in_flight and time.monotonic() - self.last_progress > self.f.stall_timeout_s:
            raise ManifestError(f"no source can provide the {len(self.pending)} missing shards")
        return None

    def _pick_duplicate(self) -> tuple[ShardRef, ShardSource] | None:
        """End game: a shard in flight from exactly one source for long enough (see `endgame_patience`), and a
        second free source holding it (peers first, the least loaded), or None. Of the seeds only the first is
        asked, and only for a shard in flight from a peer: seeds share one link, so a second seed is a
        fallback, never extra capacity."""
        now, patience = time.monotonic(), self.f.endgame_patience
        after = patience * statistics.median(self.durations) if self.durations else (2.0 if patience else 0.0)
        single = [sha for sha, keys in self.in_flight.items()
                  if len(keys) == 1 and sha in self.remaining and now - self.started[sha] >= after]
        if not single:
            return None
        sources = self._sources()
        seeds = [s for s in sources if s.seed]
        seed_keys = {s.key for s in seeds}
        peer_room = self.peer_in_flight < self.f.max_peer_parallel
        for sha in single:
            shard, busy, failed = self.refs[sha], self.in_flight[sha], self.failed.get(sha, ())
            seed_ok = not (busy & seed_keys)
            free = [s for s in sources if s.key not in busy and s.key not in failed and self._free(s)
                    and ((s is seeds[0] and seed_ok) if s.seed else peer_room or self.load.get(s.key, 0))
                    and s.holds(self.manifest, shard)]
            if free:
                return shard, min(free, key=lambda s: (s.seed, self.load.get(s.key, 0), random.random()))
        return None

    # -- the workers -----------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self.cond:
                while True:
                    if self.error is not None or not self.remaining:
                        self.cond.notify_all()
                        return
                    try:
                        picked = self._pick()
                    except BaseException as e:  # noqa: BLE001 (reported to the caller of fetch)
                        self.error = e
                        continue
                    if picked is not None:
                        break
                    t = time.monotonic()
                    self.cond.wait(self.f.poll_s)
                    self.f.stats.idle_s += time.monotonic() - t
                shard, source = picked
                if self.pending.pop(shard.sha256, None) is None:
                    self.f.stats.duplicates += 1
                began = time.monotonic()
                self.started.setdefault(shard.sha256, began)
                self.in_flight.setdefault(shard.sha256, set()).add(source.key)
                self.load[source.key] = self.load.get(source.key, 0) + 1
                self.peer_in_flight += not source.seed and self.load[source.key] == 1
            ok = False
            try:
                ok = self._fetch_one(shard, source)
            except BaseException as e:  # noqa: BLE001
                with self.cond:
                    self.error = e
            finally:
                with self.cond:
                    self.load[source.key] -= 1
                    self.peer_in_flight -= not source.seed and self.load[source.key] == 0
                    fetching = self.in_flight.get(shard.sha256, set())
                    fetching.discard(source.key)
                    if not fetching:
                        self.in_flight.pop(shard.sha256, None)
                        self.started.pop(shard.sha256, None)
                    if ok:  # `_fetch_one` took it off `remaining`, under the lock
                        self.last_progress = time.monotonic()
                        self.durations.append(self.last_progress - began)
                    elif self.error is None and shard.sha256 in self.remaining and not fetching:
                        self.pending = {shard.sha256: shard, **self.pending}  # first in line again
                    self.cond.notify_all()

    def _fetch_one(self, shard: ShardRef, source: ShardSource) -> bool:
        """Fetch `shard` from `source` into the store; False (and bookkeeping) if that failed."""
        f, stats = self.f, self.f.stats
        bad, error = False, ""
        try:
            data = source.get(self.manifest, shard)
            if len(data) != shard.size:
                raise BadShardBytes(f"{len(data)} bytes instead of {shard.size}")
            f.store.put(shard.sha256, data)  # checks the hash before anything is written
            self.assembly.write(shard.sha256, data, verified=True)  # before `remaining` says it is in
        except SourceBusy as e:
            with self.cond:
                self.busy_until[source.key] = time.monotonic() + e.retry_after_s
                stats.busy += 1
            return False
        except (BadShardBytes, ManifestError) as e:
            bad, error = True, f"bad bytes ({e})"
        except Exception as e:  # noqa: BLE001 (a failing source is skipped, never fatal: another may have it)
            error = f"{type(e).__name__}: {e}"
        if not error:
            with self.cond:
                stats.bytes_fetched += shard.size
                if shard.sha256 in self.remaining:
                    self.remaining.discard(shard.sha256)  # here, under the lock: the other copy sees it
                    stats.shards_fetched += 1
                    stats.by_source[source.name] = stats.by_source.get(source.name, 0) + 1
                else:  # the other end-game copy arrived first
                    stats.late_copies += 1
            source.on_success(self.manifest, shard)
            for top in f.sources:
                top.stored(self.manifest, shard)
            return True
        log.log(logging.WARNING if bad else logging.INFO, "shard %s from %s failed: %s", shard.sha256[:12],
                source.name, error)
        with self.cond:
            self.failed.setdefault(shard.sha256, set()).add(source.key)
            self.errors.setdefault(shard.sha256, []).append(f"{source.name}: {error}")
        source.on_failure(self.manifest, shard, error, bad)
        if bad and f.on_bad_shard is not None:
            f.on_bad_shard(source, shard)
        with self.cond:  # counted once handled: a bad shard in the stats means its source is already banned
            stats.failures += 1
            if bad:
                stats.bad_shards += 1
        return False
