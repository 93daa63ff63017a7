"""The worker node: join a pool, keep the newest verified weights, lease prompts, generate, submit signed.

Weights are fetched in a background thread and swapped into the engine between leases, so a broadcast
never stalls generation; the node always generates with the newest version it holds and says which
version that was. Every lease's sampling seeds come from the coordinator.

A node is left running for days: a coordinator that is down, restarting or unreachable is waited out (every
request is retried with backoff and jitter for as long as it takes, and the outage is logged once when it starts
and once when it ends), keeping the node's weights and identity; a coordinator that forgot the node (a new
database) is registered with again. Only a refusal that waiting cannot change stops it (`refusal.permanent`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from transformers import PreTrainedTokenizerBase

from swarmrl.models.prompts import load_tokenizer, render_prompt
from swarmrl.node.config import NodeConfig
from swarmrl.node.engine import EngineConfig, GenerationRequest, InferenceEngine
from swarmrl.node.engines import build_engine, resolve_engine_kind
from swarmrl.node.metrics import node_families
from swarmrl.node.receipts import RECEIPTS_FILE, ReceiptBook, collect_receipts
from swarmrl.node.refusal import PermanentRefusal, is_other_pool, is_unknown_node, permanent, pinned_coordinator_key
from swarmrl.node.stats import Download, NodeStats
from swarmrl.node.weights import ReadyWeights
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.manifest import ManifestError
from swarmrl.protocol.messages import (
    MAX_NODE_SECONDS,
    Lease,
    LeaseRequest,
    Registered,
    Rollout,
    RolloutGroup,
    RolloutSubmission,
    RunInfo,
)
from swarmrl.protocol.validation import is_fresh
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError, UntrustedResponse
from swarmrl.runtime.metrics import registry_of, serve_metrics
from swarmrl.runtime.retry import RetryPolicy
from swarmrl.transfer.connect import open_fetcher
from swarmrl.transfer.fetcher import CheckpointFetcher
from swarmrl.transfer.sources import ShardSource

if TYPE_CHECKING:
    from swarmrl.transfer.p2p.swarm import SwarmPeer

log = logging.getLogger("swarmrl.node")

__all__ = ["Node", "NodeStats", "PermanentRefusal", "pinned_coordinator_key"]


EngineFactory = Callable[[EngineConfig, Path, float], InferenceEngine]


class Node:
    """One worker. `run()` loops until `stop()` or `max_leases`.

    Its public steps are the seams tests and adversarial nodes build on: `join` (register, pin the key, set up
    fetching), `fetch_newer` (fetch the newest checkpoint), `load_ready_weights` (swap it into the engine),
    `wait_for_weights` (until the weights fit a lease), `generate` (a lease's groups), `step` (lease, generate
    and submit once). `engine_factory` builds the engine (`node.engines.build_engine` by default);
    `extra_sources` are shard sources tried besides the pool's."""

    def __init__(self, cfg: NodeConfig, extra_sources: list[ShardSource] | None = None, *,
                 engine_factory: EngineFactory = build_engine):
        self.cfg, self.engine_factory = cfg, engine_factory
        self.identity = Identity.load_or_create(cfg.key_path)
        self._stop = threading.Event()
        # Every request waits out an outage of any length (until stop()); the outage is logged once per outage.
        self.client = CoordinatorClient(cfg.coordinator_url, self.identity, timeout=cfg.request_timeout_s,
                                        retry=RetryPolicy(attempts=None, cap_s=cfg.max_backoff_s), stop=self._stop,
                                        coordinator_key=cfg.coordinator_key)
        self.client.outage.context = lambda: (  # never joined: nothing is kept yet, and the URL may be wrong
            f"keeping policy v{self.stats.held_version} and identity {self.identity.node_id[:10]}" if self._run_info
            else "not joined yet: check coordinator_url if that coordinator is up (`swarmrl node doctor` tries it)")
        self.stats = NodeStats()
        self.receipts: ReceiptBook | None = None
        self.download: Download | None = None  # the checkpoint being fetched, if any
        self._extra_sources = extra_sources or []
        self._run_info: RunInfo | None = None
        self.coordinator_key = cfg.coordinator_key or ""  # the key trusted, once registered
        self.weights = ReadyWeights()  # from the fetch thread to the engine
        self.engine: InferenceEngine | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.fetcher: CheckpointFetcher | None = None
        self.swarm: SwarmPeer | None = None
        self._next_lease: Lease | None = None  # granted with the last submission (`RolloutSubmission.next_lease`)

    # -- weights --------------------------------------------------------------------------------------

    def fetch_newer(self) -> None:
        """Fetch the coordinator's newest manifest if it is newer than anything held or ready."""
        assert self.fetcher is not None
        newest = max(self._versions_in_use())
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
        self.weights.offer(manifest.version, path)

    def _shards_stored(self) -> int:
        f = self.fetcher
        return 0 if f is None else f.stats.shards_fetched + f.stats.shards_reused

    def download_progress(self) -> tuple[Download, int] | None:
        """The checkpoint being fetched and how many of its shards are stored so far, or None."""
        d = self.download
        return None if d is None else (d, min(max(self._shards_stored() - d.counter_at_start, 0), d.shards))

    def fetch_loop(self) -> None:
        """Fetch newer checkpoints until stop(). Requests wait out outages in the client; a fetch that fails
        anyway (a bad manifest, a full disk, a shard no source could give) is tried again later."""
        failures = 0
        while not self._stop.is_set():
            try:
                self.fetch_newer()
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
            self._stop.wait(self._backoff(failures) if failures else self.cfg.poll_interval_s)

    def _backoff(self, failures: int) -> float:
        """Full jitter over poll_interval_s * 2^failures, capped at max_backoff_s."""
        return random.uniform(0, min(self.cfg.max_backoff_s, self.cfg.poll_interval_s * 2 ** min(failures, 20)))

    def load_ready_weights(self, temperature: float, max_version: int | None = None) -> None:
        """Load the newest fetched checkpoint, if there is one (and, with `max_version`, if it is no newer)."""
        with self.weights.take(max_version) as ready:
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

    def _versions_in_use(self) -> set[int]:
        """The versions the fetcher keeps on disk whatever their age: held, being loaded, or ready."""
        return {self.stats.held_version, *self.weights.versions()}

    def wait_for_weights(self, lease: Lease, max_staleness: int, temperature: float) -> None:
        """Wait (up to the lease's expiry) for weights recent enough that the lease's groups will be accepted.

        Groups from a policy more than `max_staleness` versions behind the lease's are refused, so generating them
        would only waste the node's time. Weights newer than the lease's version are never loaded for it (the
        verifier bans a node that generates with them); when only such weights are coming, the node gives up
        waiting: its stale submission is refused, which frees the lease."""
        while not is_fresh(self.stats.held_version, lease.policy_version, max_staleness) and not self._stop.is_set():
            if time.time() > lease.expires_at or self.stats.held_version > lease.policy_version:
                return
            if self.weights.newer_than(lease.policy_version):
                return
            t0 = time.perf_counter()
            self._stop.wait(0.05)
            self.stats.idle_seconds += time.perf_counter() - t0
            self.load_ready_weights(temperature, max_version=lease.policy_version)

    # -- work -----------------------------------------------------------------------------------------

    def generate(self, lease: Lease) -> RolloutSubmission:
        assert self.engine is not None and self.tokenizer is not None
        requests, owners = [], []
        prompt_ids: dict[str, list[int]] = {}
        for p in lease.prompts:
            prompt_ids[p.prompt_id] = render_prompt(self.tokenizer, p.text)
            for seed in p.seeds:
                requests.append(GenerationRequest(prompt_ids=prompt_ids[p.prompt_id], seed=seed))
                owners.append(p.prompt_id)
        t0 = time.perf_counter()
        completions = self.engine.generate(requests, max_tokens=lease.sampling.max_tokens)
        gen_s = time.perf_counter() - t0
        self.stats.gen_seconds += gen_s
        by_prompt: dict[str, list[Rollout]] = {p.prompt_id: [] for p in lease.prompts}
        for req, owner, c in zip(requests, owners, completions, strict=True):
            self.stats.tokens += len(c.token_ids)
            by_prompt[owner].append(Rollout(seed=req.seed, completion_ids=c.token_ids, logprobs=c.logprobs,
                                            finish_reason=c.finish_reason, proof=c.proof))
        groups = [RolloutGroup(prompt_id=pid, prompt_ids=prompt_ids[pid], rollouts=rs) for pid, rs in by_prompt.items()]
        return RolloutSubmission(lease_id=lease.lease_id, policy_version=self.stats.held_version, groups=groups,
                                 gen_seconds=gen_s)

    def step(self) -> bool:
        """Lease, generate and submit once. False when there was no work (the caller waits)."""
        assert self._run_info is not None
        run = self._run_info.spec
        lease, self._next_lease = self._next_lease, None
        if lease is not None and (lease.expires_at <= time.time() or lease.policy_version < self.stats.held_version):
            lease = None  # expired, or older than the weights loaded (never the case: leases only move on)
        # Weights newer than a lease that came with the last submission wait for the next lease (groups from
        # weights newer than their lease's are refused, and their node banned).
        self.load_ready_weights(run.sampling.temperature, max_version=None if lease is None else lease.policy_version)
        if self.engine is None:
            self._next_lease = lease
            return False
        if lease is None:  # none came with the last submission (or this is the first)
            lease = self.client.lease(self.cfg.max_prompts, held_version=self.stats.held_version)
            if lease is None:
                self.stats.ask_why_no_work(self.client, time.monotonic())
                return False
        self.stats.count_lease()
        self.wait_for_weights(lease, run.max_staleness, run.sampling.temperature)
        t0 = time.perf_counter()
        submission = self.generate(lease)
        last = self.cfg.max_leases is not None and self.stats.leases >= self.cfg.max_leases
        if not self._stop.is_set() and not last:  # the next lease comes with this answer: one round trip fewer
            submission.next_lease = LeaseRequest(max_prompts=self.cfg.max_prompts, held_version=self.stats.held_version)
        try:
            result = self.client.submit(submission)
        except CoordinatorError as e:
            self.stats.count_refused(submission, e)
            if permanent(e, self.cfg) is not None or is_unknown_node(e) or is_other_pool(e):
                raise  # the main loop stops, or registers again
            return True
        finally:
            self.stats.busy_seconds += time.perf_counter() - t0
        self.stats.count_result(submission, result)
        self._next_lease = result.next_lease
        return True

    def _register(self) -> Registered:
        """Register (waiting out a coordinator that cannot be reached), check its key against the one trusted,
        and take its run description. PermanentRefusal when banned or when the key is not the trusted one."""
        try:
            # The key is settled (configured, pinned on first use, or refused) before anything is signed for it.
            info = self.client.info(trust=False)
            self.coordinator_key = pinned_coordinator_key(self.cfg, info.coordinator_key)
            self.client.coordinator_key = self.coordinator_key
            self.client.trust(info)
            reg = self.client.register(name=self.cfg.name or self.identity.node_id[:8],
                                        engine=resolve_engine_kind(self.cfg.engine))
        except UntrustedResponse as e:
            raise PermanentRefusal(f"the coordinator at {self.cfg.coordinator_url} did not prove its key: "
                                   f"{e.reason}") from None
        except CoordinatorError as e:
            raise permanent(e, self.cfg) or e from None
        if self._run_info is not None and reg.run.spec != self._run_info.spec:
            log.warning("the coordinator's run description changed: %s", reg.run.spec.mismatch(self._run_info.spec))
        self._run_info = reg.run
        self.stats.registrations += 1
        self.stats.current_version = max(self.stats.current_version, reg.run.current_version)
        return reg

    def _refused(self, e: CoordinatorError) -> None:
        """Deal with a refusal in the main loop: stop (PermanentRefusal), register again, or note it and go on."""
        stop = permanent(e, self.cfg)
        if stop is not None:
            raise stop
        self.stats.last_error = e.reason
        if isinstance(e, UntrustedResponse):  # e.g. a lease rewritten on the way: not acted on
            self.stats.untrusted += 1
            log.warning("%s", e.reason)
            return
        if is_unknown_node(e) or is_other_pool(e):
            log.warning("the coordinator does not know this node (a new database, a new run, another key?): "
                        "registering again")
            try:
                self._register()
            except CoordinatorError as again:  # e.g. too many challenges at once: the main loop backs off
                self.stats.last_error = again.reason
                log.warning("registering again was refused: %s", again.reason)
            return
        log.warning("coordinator refused: %s", e.reason)

    def join(self) -> None:
        """Register with the pool, pin its key, join the checkpoint swarm if it has one, set up fetching.

        Only this first registration gives up, after join_timeout_s (when set), on a coordinator it cannot reach."""
        policy = self.client.retry
        self.client.retry = replace(policy, give_up_after_s=self.cfg.join_timeout_s)
        try:
            reg = self._register()
        except httpx.TransportError as e:
            if self._stop.is_set():
                raise
            raise ConnectionError(f"could not reach the coordinator at {self.cfg.coordinator_url} for "
                                  f"{self.cfg.join_timeout_s:.0f} s (join_timeout_s): {e}; `swarmrl node doctor` "
                                  "checks the URL and the network") from e
        finally:
            self.client.retry = policy
        key = self.coordinator_key
        self.receipts = ReceiptBook(self.cfg.work_dir / RECEIPTS_FILE, self.identity.node_id, key)
        self.stats.receipts, self.stats.receipt_tokens = self.receipts.count, self.receipts.tokens
        # The swarm is None when the pool has none, p2p is off, or its daemon cannot start: the HTTP origin then.
        self.fetcher, self.swarm = open_fetcher(
            self.cfg.work_dir / "checkpoints", key, self.client, reg.run, p2p=self.cfg.p2p, fetch=self.cfg.fetch,
            keep_versions=self.cfg.keep_versions, extra_sources=self._extra_sources, in_use=self._versions_in_use)
        log.info("registered as %s with %s (run %s)", reg.node_id, self.cfg.coordinator_url, reg.run.run_id)

    def run(self) -> NodeStats:
        """Join, then lease, generate and submit until stop() or max_leases, serving metrics on `metrics_port`
        meanwhile. Raises PermanentRefusal when the pool refuses the node for good (its message says what to do)."""
        metrics = serve_metrics(registry_of(lambda: node_families(
            self.identity.node_id, self.cfg.name, self.stats, self.client.outage,
            self.fetcher.stats if self.fetcher is not None else None)), self.cfg.metrics_host, self.cfg.metrics_port)
        try:
            return self._run()
        finally:
            if metrics is not None:
                metrics.close()

    def _run(self) -> NodeStats:
        try:
            self.join()
        except httpx.TransportError:
            if self._stop.is_set():  # stopped before the coordinator could be reached
                return self.stats
            raise
        fetch_thread = threading.Thread(target=self.fetch_loop, name="fetch", daemon=True)
        fetch_thread.start()
        last_beat, last_receipts, refusals = 0.0, time.time(), 0
        try:
            while not self._stop.is_set():
                if self.cfg.max_leases is not None and self.stats.leases >= self.cfg.max_leases:
                    break
                try:
                    worked = self.step()
                    if time.time() - last_beat > self.cfg.heartbeat_interval_s:
                        last_beat = time.time()
                        self.client.heartbeat(self.stats.held_version, status="generating" if worked else "idle",
                                              idle_s=min(self.stats.idle_seconds, MAX_NODE_SECONDS),
                                              busy_s=min(self.stats.busy_seconds, MAX_NODE_SECONDS))
                    if time.time() - last_receipts > self.cfg.receipts_interval_s:
                        last_receipts = time.time()
                        self.collect_receipts()
                    refusals = 0
                except CoordinatorError as e:
                    self._refused(e)
                    worked, refusals = False, refusals + 1
                except httpx.TransportError:
                    if self._stop.is_set():  # a request given up because the node is stopping
                        break
                    raise
                if not worked:
                    t0 = time.perf_counter()
                    # Refused again and again (a full lease book, a coordinator shedding load): back off.
                    self._stop.wait(self._backoff(refusals) if refusals else self.cfg.poll_interval_s)
                    self.stats.idle_seconds += time.perf_counter() - t0
        finally:
            self._stop.set()
            fetch_thread.join(timeout=5)
            if self.engine is not None:
                self.engine.close()
            if self.swarm is not None:
                self.swarm.close()
        return self.stats

    def collect_receipts(self) -> int:
        """Collect the receipts the coordinator signed for this node since the last ones held (`node.receipts`);
        how many new ones were kept. A refusal (e.g. a coordinator without receipts) is logged, not raised."""
        assert self.receipts is not None
        try:
            new = collect_receipts(self.client, self.receipts)
        except CoordinatorError as e:
            log.warning("collecting receipts was refused: %s", e.reason)
            return 0
        self.stats.receipts, self.stats.receipt_tokens = self.receipts.count, self.receipts.tokens
        return new

    def stop(self) -> None:
        self._stop.set()
