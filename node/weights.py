"""A node's weights: the fetch thread that keeps the newest verified checkpoint, and its hand-over to the engine.

Checkpoints are fetched in a background thread (`fetch_loop`) and swapped into the engine between leases (`load`),
so a broadcast never stalls generation. A node only moves forward: a version no newer than what it holds or has
ready is not fetched. It never loads, for a lease, weights newer than the lease's (the verifier bans a node that
generates with them); `wait_once` is one wait for weights recent enough for a lease.

`Weights` is built from `WeightsConfig` (the node config's fields it reads) and talks to the coordinator through
`WeightsClient`, the few calls it makes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import httpx
from transformers import PreTrainedTokenizerBase

from swarmrl.models.prompts import load_tokenizer
from swarmrl.node.config import NodeConfig
from swarmrl.node.engine import EngineConfig, InferenceEngine
from swarmrl.node.engines import build_engine
from swarmrl.node.handover import ReadyWeights
from swarmrl.node.inflight import Updates
from swarmrl.node.stats import Download, NodeStats
from swarmrl.protocol.manifest import ManifestError, SignedManifest
from swarmrl.protocol.messages import Lease, RunInfo
from swarmrl.protocol.validation import is_fresh
from swarmrl.runtime.client import CoordinatorError
from swarmrl.runtime.retry import RetryPolicy
from swarmrl.transfer.connect import open_fetcher
from swarmrl.transfer.fetcher import CheckpointFetcher, FetchConfig
from swarmrl.transfer.p2p.config import P2PConfig
from swarmrl.transfer.sources import ShardSource

if TYPE_CHECKING:
    from swarmrl.transfer.download import FetchStats
    from swarmrl.transfer.p2p.swarm import SwarmPeer

log = logging.getLogger("swarmrl.node")

EngineFactory = Callable[[EngineConfig, Path, float], InferenceEngine]
WAIT_STEP_S = 0.05


class WeightsClient(Protocol):
    """The coordinator calls a node's weights make (`runtime.client.CoordinatorClient` has them all): the run's
    current version, its newest manifest, and, through the fetcher's HTTP origin, manifests and shards."""

    def info(self) -> RunInfo: ...

    def latest_manifest(self) -> SignedManifest | None: ...

    def manifest(self, version: int) -> SignedManifest | None: ...

    def shard(self, sha256: str) -> bytes: ...


@dataclass(frozen=True)
class WeightsConfig:
    """The node config's fields the weights read."""

    checkpoints_dir: Path
    keep_versions: int
    poll_interval_s: float
    max_backoff_s: float
    engine: EngineConfig
    p2p: P2PConfig
    fetch: FetchConfig

    @classmethod
    def from_node(cls, cfg: NodeConfig) -> WeightsConfig:
        return cls(checkpoints_dir=cfg.work_dir / "checkpoints", keep_versions=cfg.keep_versions,
                   poll_interval_s=cfg.poll_interval_s, max_backoff_s=cfg.max_backoff_s, engine=cfg.engine,
                   p2p=cfg.p2p, fetch=cfg.fetch)


class Weights(ReadyWeights):
    """The hand-over (`ReadyWeights`: `offer`, `ready`, `take`) with the fetch thread that feeds it and the engine it
    empties into. `held_version` is kept in the node's `stats`; `engine` and `tokenizer` are None until the first
    checkpoint is loaded; `fetcher` and `swarm` until `open`."""

    def __init__(self, cfg: WeightsConfig, client: WeightsClient, stats: NodeStats, stop: threading.Event, *,
                 engine_factory: EngineFactory = build_engine, extra_sources: list[ShardSource] | None = None):
        super().__init__(stats)
        self.cfg, self.client, self._stop = cfg, client, stop
        self.engine_factory = engine_factory
        self.extra_sources = extra_sources or []
        self.engine: InferenceEngine | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.fetcher: CheckpointFetcher | None = None
        self.swarm: SwarmPeer | None = None
        self.download: Download | None = None  # the checkpoint being fetched, if any
        self.preparing = False
        """Whether the fetch thread (`start`) prepares ready checkpoints for the engine (`prepare_ready`)."""
        # Full jitter over poll_interval_s * 2^failures, capped at max_backoff_s.
        self.backoff = RetryPolicy(attempts=None, base_s=cfg.poll_interval_s, cap_s=cfg.max_backoff_s)

    def open(self, coordinator_key: str, run: RunInfo) -> None:
        """Set up fetching for the pool `run` describes: its swarm when it has one (and p2p is on), the
        coordinator's HTTP origin, and `extra_sources`."""
        c = self.cfg
        # The swarm is None when the pool has none, p2p is off, or its daemon cannot start: the HTTP origin then.
        self.fetcher, self.swarm = open_fetcher(
            c.checkpoints_dir, coordinator_key, self.client, run, p2p=c.p2p, fetch=c.fetch,  # type: ignore[arg-type]
            keep_versions=c.keep_versions, extra_sources=self.extra_sources, in_use=self.in_use)

    # -- fetching (the fetch thread) ------------------------------------------------------------------------------

    def fetch_newer(self) -> None:
        """Fetch the coordinator's newest manifest if it is newer than anything held or ready."""
        assert self.fetcher is not None
        newest = max(self.in_use())
        # /v1/info is a few hundred bytes; the manifest of a large model lists thousands of shards.
        current = self.client.info().current_version
        if current < self.stats.current_version:
            log.warning("the coordinator's policy version went back from %d to %d (a new run on the same key?); "
                        "this node keeps its version %d", self.stats.current_version, current, newest)
        self.stats.current_version = current
        if current <= newest:
            return
        signed = self.client.latest_manifest()
        # A node only ever moves forward: a version no newer than what it holds or has ready is not fetched (the
        # fetcher checks the signature, so the version fetched is the one checked here).
        if signed is None or signed.manifest.version <= newest:
            return
        # For the panel only: the download's size as the (not yet verified) manifest states it.
        m = signed.manifest
        self.download = Download(m.version, len(m.shards()), m.total_bytes, self._shards_stored())
        try:
            manifest, path = self.fetcher.fetch(signed)
        finally:
            self.download = None
        self.offer(manifest.version, path)

    def prepare_ready(self) -> None:
        """Have the engine prepare the ready checkpoint, if it stages its updates (the vLLM engine on the CPU) and has
        not yet: here, off the generating thread, so that loading it stops generation only for a swap. A failure is
        logged; loading it then raises on the generating thread, as without preparation."""
        engine, ready = self.engine, self.ready  # read once: the other thread may replace them
        if ready is None or engine is None or engine.prepared(ready[1]):
            return
        try:
            engine.prepare(ready[1])
        except Exception as e:
            log.warning("preparing the checkpoint of version %d failed: %s", ready[0], e)

    def fetch_loop(self) -> None:
        """Fetch newer checkpoints until stop. Requests wait out outages in the client; a fetch that fails anyway
        (a bad manifest, a full disk, a shard no source could give) is tried again later."""
        failures = 0
        while not self._stop.is_set():
            try:
                self.fetch_newer()
                self.prepare_ready()
                failures = 0
            except Exception as e:  # keep the fetch thread alive: the main loop still works with old weights
                if self._stop.is_set():
                    break
                failures += 1
                self.stats.last_error = f"fetch: {e}"
                if isinstance(e, ManifestError | CoordinatorError | OSError | httpx.HTTPError):
                    log.warning("checkpoint fetch failed: %s", e)
                else:
                    log.exception("checkpoint fetch crashed")
            self._stop.wait(self.backoff.delay(failures) if failures else self.cfg.poll_interval_s)

    def start(self) -> threading.Thread:
        """The fetch thread, started (it ends once stop is set)."""
        thread = threading.Thread(target=self.fetch_loop, name="fetch", daemon=True)
        self.preparing = True
        thread.start()
        return thread

    def _shards_stored(self) -> int:
        f = self.fetcher
        return 0 if f is None else f.stats.shards_fetched + f.stats.shards_reused

    def download_progress(self) -> tuple[Download, int] | None:
        """The checkpoint being fetched and how many of its shards are stored so far, or None."""
        d = self.download
        return None if d is None else (d, min(max(self._shards_stored() - d.counter_at_start, 0), d.shards))

    def fetch_stats(self) -> FetchStats | None:
        """The fetcher's counters, once it is set up."""
        return None if self.fetcher is None else self.fetcher.stats

    # -- the hand-over to the engine (the generating thread) ------------------------------------------------------

    def load(self, temperature: float, max_version: int | None = None) -> None:
        """Load the newest fetched checkpoint, if there is one (and, with `max_version`, if it is no newer)."""
        with self.take(max_version) as ready:
            if ready is None:
                return
            version, path = ready
            if self.engine is None or self.engine.temperature != temperature:
                if self.engine is not None:
                    self.engine.close()
                self.engine = self.engine_factory(self.cfg.engine, path, temperature)
                self.tokenizer = load_tokenizer(path)
            else:
                self.engine.load(path)
            self.stats.held_version = version
        log.info("now generating with policy version %d", version)

    def in_flight(self, temperature: float, max_version: int) -> Updates:
        """In-flight updates (`node.inflight`) of a lease: versions ready up to `max_version`, loaded in place. A
        version counts as ready once the engine has prepared it (`prepare_ready`, in the fetch thread, once started): a
        lease stops only for the swap."""
        def ready() -> bool:
            ready = self.ready  # read once: the fetch thread may replace it
            if ready is None or not self.stats.held_version < ready[0] <= max_version:
                return False
            # Not yet prepared: the fetch thread is on it (without one, `load` prepares it).
            engine = self.engine
            return not self.preparing or engine is None or engine.prepared(ready[1])

        def load() -> int | None:
            before = self.stats.held_version
            self.load(temperature, max_version)
            return self.stats.held_version if self.stats.held_version != before else None

        return Updates(ready, load)

    def wait_once(self, lease: Lease, max_staleness: int) -> bool:
        """Wait a moment for weights recent enough that `lease`'s groups will be accepted; False when there is no
        more reason to wait (the weights held are fresh enough, the node is stopping, or waiting is hopeless).

        Groups from a policy more than `max_staleness` versions behind the lease's are refused, so generating them
        would only waste the node's time. Weights newer than the lease's version are never loaded for it; when
        only such weights are coming (or the lease expired), waiting is hopeless: the stale submission is refused,
        which frees the lease. After a True the caller loads what is ready up to the lease's version."""
        held = self.stats.held_version
        if is_fresh(held, lease.policy_version, max_staleness) or self._stop.is_set():
            return False
        if time.time() > lease.expires_at or held > lease.policy_version or self.newer_than(lease.policy_version):
            return False
        t0 = time.perf_counter()
        self._stop.wait(WAIT_STEP_S)
        self.stats.idle_seconds += time.perf_counter() - t0
        return True

    def close(self) -> None:
        """Close the engine and leave the swarm."""
        if self.engine is not None:
            self.engine.close()
        if self.swarm is not None:
            self.swarm.close()
