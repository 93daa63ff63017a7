"""The executor of one download: worker threads that ask `transfer.schedule.choose` what to fetch, fetch it,
check it, store it, write it into the checkpoint's files and report the outcome back into the state.

All scheduling decisions are `choose`'s; this module only owns what a pure function cannot: the threads, the
lock (a condition the workers wait on when there is nothing to start), the clock, and the calls to sources
(`expand`/`held` to make the views, `suggest` when a seed is consulted, `get`, and the hooks).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from swarmrl.protocol.manifest import CheckpointManifest, ManifestError, ShardRef
from swarmrl.transfer.schedule import (
    Consult,
    DownloadState,
    Fail,
    Pick,
    Policy,
    SourceView,
    Wait,
    choose,
    needs_sources,
)
from swarmrl.transfer.sources import BadShardBytes, ShardNotHeld, ShardSource, SourceBusy
from swarmrl.transfer.store import CheckpointAssembly, ShardStore

log = logging.getLogger(__name__)


class ShardUnavailable(ManifestError):
    """A shard could not be fetched because no source has it (the origin no longer keeps the version)."""


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


class Download:
    """The missing shards of one manifest, fetched by `workers` threads (the calling thread when one).

    `run` returns once every shard is stored and written into `assembly`: an end-game duplicate still
    downloading finishes in the background (its copy is stored or dropped like any other) instead of holding
    up the checkpoint. It raises the first error: `ShardUnavailable`, ManifestError, or what a hook raised.
    """

    def __init__(self, manifest: CheckpointManifest, missing: list[ShardRef], assembly: CheckpointAssembly,
                 store: ShardStore, sources: list[ShardSource], policy: Policy, poll_s: float, workers: int,
                 stats: FetchStats, on_bad_shard: Callable[[ShardSource, ShardRef], None] | None = None):
        self.manifest = manifest
        self.assembly = assembly
        self.store = store
        self.sources = sources
        self.policy = policy
        self.poll_s = poll_s
        self.workers = max(1, workers)
        self.stats = stats
        self.on_bad_shard = on_bad_shard
        # Rotation: every download starts at its own random place in the shard list, so that nodes starting
        # together take different shards from the seed.
        rotation = random.randrange(len(missing)) if self.workers > 1 and missing else 0
        self.state = DownloadState.begin(missing, time.monotonic(), rotation, salt=random.getrandbits(32))
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def run(self) -> None:
        n = min(self.workers, len(self.state.pending))
        if n == 1:
            self._work()
        elif n > 1:
            threads = [threading.Thread(target=self._work, name=f"fetch-{i}", daemon=True) for i in range(n)]
            for t in threads:
                t.start()
            with self.cond:
                while self.state.remaining and self.error is None and any(t.is_alive() for t in threads):
                    self.cond.wait(0.5)
        if self.error is not None:
            raise self.error

    # -- deciding (under the lock) ---------------------------------------------------------------------

    def _views(self) -> list[SourceView]:
        wanted = {sha: self.state.refs[sha] for sha in self.state.remaining}
        out: list[SourceView] = []
        for top in self.sources:
            try:
                expanded = top.expand(self.manifest)
            except Exception:  # noqa: BLE001 (discovery trouble must not stop the seeds)
                continue
            out.extend(SourceView(s.key, s.name, s.seed, s.held(self.manifest, wanted), s) for s in expanded)
        return out

    def _decide(self) -> Pick | Wait:
        """`choose`'s answer now, with the seeds it consults asked in turn; raises on Fail."""
        now = time.monotonic()
        views = self._views() if needs_sources(self.state, now, self.policy) else []
        hints: dict[str, object] = {}
        while True:
            decision = choose(self.state, views, now, self.policy, hints)
            if isinstance(decision, Consult):
                assert decision.seed.source is not None
                hints[decision.seed.key] = decision.seed.source.suggest(self.manifest, list(decision.queue))
                continue
            if isinstance(decision, Fail):
                raise (ShardUnavailable if decision.unavailable else ManifestError)(decision.reason)
            return decision

    # -- the workers -----------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self.cond:
                while True:
                    if self.error is not None or not self.state.remaining:
                        self.cond.notify_all()
                        return
                    try:
                        decision = self._decide()
                    except BaseException as e:  # noqa: BLE001 (reported to the caller of run)
                        self.error = e
                        continue
                    if isinstance(decision, Pick):
                        break
                    t = time.monotonic()
                    self.cond.wait(self.poll_s)
                    self.stats.idle_s += time.monotonic() - t
                pick = decision
                began = time.monotonic()
                if self.state.start(pick, began):
                    self.stats.duplicates += 1
            ok = False
            try:
                assert pick.source.source is not None
                ok = self._fetch_one(pick.shard, pick.source.source)
            except BaseException as e:  # noqa: BLE001
                with self.cond:
                    self.error = e
            finally:
                with self.cond:
                    self.state.end(pick, began, time.monotonic(), ok, requeue=self.error is None)
                    self.cond.notify_all()

    def _fetch_one(self, shard: ShardRef, source: ShardSource) -> bool:
        """Fetch `shard` from `source` into the store and the files; False (and bookkeeping) if that failed."""
        stats = self.stats
        bad, not_held, error = False, False, ""
        try:
            data = source.get(self.manifest, shard)
            if len(data) != shard.size:
                raise BadShardBytes(f"{len(data)} bytes instead of {shard.size}")
            self.store.put(shard.sha256, data)  # checks the hash before anything is written
            self.assembly.write(shard.sha256, data, verified=True)  # before the state says it is in
        except SourceBusy as e:
            with self.cond:
                self.state.busy(source.key, time.monotonic() + e.retry_after_s)
                stats.busy += 1
            return False
        except (BadShardBytes, ManifestError) as e:
            bad, error = True, f"bad bytes ({e})"
        except ShardNotHeld as e:
            not_held, error = True, str(e)
        except Exception as e:  # noqa: BLE001 (a failing source is skipped, never fatal: another may have it)
            error = f"{type(e).__name__}: {e}"
        if not error:
            with self.cond:
                stats.bytes_fetched += shard.size
                if self.state.delivered(shard.sha256):  # here, under the lock: the other copy sees it
                    stats.shards_fetched += 1
                    stats.by_source[source.name] = stats.by_source.get(source.name, 0) + 1
                else:  # the other end-game copy arrived first
                    stats.late_copies += 1
            source.on_success(self.manifest, shard)
            for top in self.sources:
                top.stored(self.manifest, shard)
            return True
        log.log(logging.WARNING if bad else logging.INFO, "shard %s from %s failed: %s", shard.sha256[:12],
                source.name, error)
        with self.cond:
            self.state.failed_by(shard.sha256, source.key, f"{source.name}: {error}", not_held=not_held)
        source.on_failure(self.manifest, shard, error, bad)
        if bad and self.on_bad_shard is not None:
            self.on_bad_shard(source, shard)
        with self.cond:  # counted once handled: a bad shard in the stats means its source is already banned
            stats.failures += 1
            if bad:
                stats.bad_shards += 1
        return False
