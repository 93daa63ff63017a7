"""The worker node: join a pool, keep the newest verified weights, lease prompts, generate, submit signed.

Weights are fetched in a background thread and swapped into the engine between leases, so a broadcast
never stalls generation; the node always generates with the newest version it holds and says which
version that was. Every lease's sampling seeds come from the coordinator.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from transformers import PreTrainedTokenizerBase

from swarmrl.models.prompts import load_tokenizer, render_prompt
from swarmrl.node.config import NodeConfig
from swarmrl.node.engine import GenerationRequest, InferenceEngine, build_engine, resolve_engine_kind
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.manifest import ManifestError
from swarmrl.protocol.messages import MAX_NODE_SECONDS, Lease, Registered, Rollout, RolloutGroup, RolloutSubmission
from swarmrl.protocol.validation import is_fresh
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.transfer.connect import open_fetcher
from swarmrl.transfer.fetcher import CheckpointFetcher
from swarmrl.transfer.sources import ShardSource

if TYPE_CHECKING:
    from swarmrl.transfer.p2p.swarm import SwarmPeer

log = logging.getLogger("swarmrl.node")


@dataclass
class NodeStats:
    leases: int = 0
    groups_submitted: int = 0
    groups_refused: int = 0
    tokens: int = 0
    gen_seconds: float = 0.0
    idle_seconds: float = 0.0  # waiting for work, or for weights recent enough for a lease
    busy_seconds: float = 0.0  # generating and submitting
    held_version: int = -1
    last_error: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.gen_seconds if self.gen_seconds else 0.0


def pinned_coordinator_key(cfg: NodeConfig, reported: str) -> str:
    """The coordinator key to trust: the configured one, else the one pinned on first use."""
    if cfg.coordinator_key:
        if cfg.coordinator_key != reported:
            raise RuntimeError("the coordinator presents a different key than the one configured: refusing")
        return cfg.coordinator_key
    pin = Path(str(cfg.key_path) + ".coordinator")
    if pin.exists():
        pinned = pin.read_text().strip()
        if pinned != reported:
            raise RuntimeError(f"coordinator key changed since first use (pinned in {pin}): refusing")
        return pinned
    pin.write_text(reported + "\n")
    log.warning("trusting coordinator key %s… on first use (pinned in %s)", reported[:16], pin)
    return reported


class Node:
    """One worker. `run()` loops until `stop()` or `max_leases`."""

    def __init__(self, cfg: NodeConfig, extra_sources: list[ShardSource] | None = None):
        self.cfg = cfg
        self.identity = Identity.load_or_create(cfg.key_path)
        self.client = CoordinatorClient(cfg.coordinator_url, self.identity)
        self.stats = NodeStats()
        self._extra_sources = extra_sources or []
        self._stop = threading.Event()
        self._ready: tuple[int, Path] | None = None  # newest verified checkpoint not yet loaded
        self._ready_lock = threading.Lock()
        self.engine: InferenceEngine | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.fetcher: CheckpointFetcher | None = None
        self.swarm: SwarmPeer | None = None

    # -- weights --------------------------------------------------------------------------------------

    def _fetch_newer(self) -> None:
        """Fetch the coordinator's newest manifest if it is newer than anything held or ready."""
        assert self.fetcher is not None
        with self._ready_lock:
            newest = max(self.stats.held_version, self._ready[0] if self._ready else -1)
        # /v1/info is a few hundred bytes; the manifest of a large model lists thousands of shards.
        if self.client.info().current_version <= newest:
            return
        signed = self.client.latest_manifest()
        # A node only ever moves forward: a version no newer than what it holds or has ready is not fetched (the
        # fetcher checks the signature, so the version fetched is the one checked here).
        if signed is None or signed.manifest.version <= newest:
            return
        manifest, path = self.fetcher.fetch(signed)
        with self._ready_lock:
            self._ready = (manifest.version, path)

    def _fetch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._fetch_newer()
            except (ManifestError, CoordinatorError, OSError) as e:
                self.stats.last_error = f"fetch: {e}"
                log.warning("checkpoint fetch failed: %s", e)
            except Exception as e:  # keep the fetch thread alive: the main loop still works with old weights
                self.stats.last_error = f"fetch: {e}"
                log.exception("checkpoint fetch crashed")
            self._stop.wait(self.cfg.poll_interval_s)

    def _swap_in_weights(self, temperature: float, max_version: int | None = None) -> None:
        """Load the newest fetched checkpoint, if there is one (and, with `max_version`, if it is no newer)."""
        with self._ready_lock:
            ready = self._ready
            if ready is None or (max_version is not None and ready[0] > max_version):
                return
            self._ready = None
        version, path = ready
        if self.engine is None or self.engine.temperature != temperature:
            if self.engine is not None:
                self.engine.close()
            self.engine = build_engine(self.cfg.engine, path, temperature)
            self.tokenizer = load_tokenizer(path)
        else:
            self.engine.load(path)
        self.stats.held_version = version
        log.info("now generating with policy version %d", version)

    def _catch_up(self, lease: Lease, max_staleness: int, temperature: float) -> None:
        """Wait (up to the lease's expiry) for weights recent enough that the lease's groups will be accepted.

        Groups from a policy more than `max_staleness` versions behind the lease's are refused, so
        generating them would only waste the node's time. Weights newer than the lease's version are never
        loaded for it (the verifier bans a node that generates with them); when only such weights are
        coming, the node gives up waiting: its stale submission is refused, which frees the lease.
        """
        while not is_fresh(self.stats.held_version, lease.policy_version, max_staleness) and not self._stop.is_set():
            if time.time() > lease.expires_at or self.stats.held_version > lease.policy_version:
                return
            with self._ready_lock:
                if self._ready is not None and self._ready[0] > lease.policy_version:
                    return
            t0 = time.perf_counter()
            self._stop.wait(0.05)
            self.stats.idle_seconds += time.perf_counter() - t0
            self._swap_in_weights(temperature, max_version=lease.policy_version)

    # -- work -----------------------------------------------------------------------------------------

    def _generate(self, lease: Lease) -> RolloutSubmission:
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
        run = self._run_info.spec
        self._swap_in_weights(run.sampling.temperature)
        if self.engine is None:
            return False
        lease = self.client.lease(self.cfg.max_prompts, held_version=self.stats.held_version)
        if lease is None:
            return False
        self.stats.leases += 1
        self._catch_up(lease, run.max_staleness, run.sampling.temperature)
        t0 = time.perf_counter()
        submission = self._generate(lease)
        try:
            result = self.client.submit(submission)
        except CoordinatorError as e:
            self.stats.groups_refused += len(submission.groups)
            self.stats.last_error = e.reason
            log.warning("submission refused: %s", e.reason)
            return True
        finally:
            self.stats.busy_seconds += time.perf_counter() - t0
        # The client retries a submit whose response was lost; the coordinator then answers "already
        # submitted" for groups the first attempt delivered. Those were taken, not refused.
        refused = {pid: r for pid, r in result.rejected.items() if r != "already submitted"}
        self.stats.groups_submitted += len(result.accepted) + len(result.rejected) - len(refused)
        self.stats.groups_refused += len(refused)
        for pid, reason in refused.items():
            log.warning("group %s refused: %s", pid, reason)
        return True

    def _register(self) -> Registered:
        """Register, waiting out a coordinator that is not reachable yet (starting, restarting) for up to
        `join_timeout_s`; a refusal (4xx) is final and raised at once."""
        deadline = time.time() + self.cfg.join_timeout_s
        while True:
            try:
                return self.client.register(name=self.cfg.name or self.identity.node_id[:8],
                                            engine=resolve_engine_kind(self.cfg.engine))
            except httpx.TransportError as e:
                if time.time() > deadline:
                    raise
                log.warning("coordinator %s not reachable yet (%s); retrying", self.cfg.coordinator_url, e)
                self._stop.wait(2.0)

    def _setup(self) -> None:
        """Register with the pool, pin its key, join the checkpoint swarm if it has one, set up fetching."""
        reg = self._register()
        self._run_info = reg.run
        key = pinned_coordinator_key(self.cfg, reg.run.coordinator_key)
        # The swarm is None when the pool has none, p2p is off, or its daemon cannot start: the HTTP origin then.
        self.fetcher, self.swarm = open_fetcher(
            self.cfg.work_dir / "checkpoints", key, self.client, reg.run, p2p=self.cfg.p2p, fetch=self.cfg.fetch,
            keep_versions=self.cfg.keep_versions, extra_sources=self._extra_sources)
        log.info("registered as %s with %s (run %s)", reg.node_id, self.cfg.coordinator_url, reg.run.run_id)

    def run(self) -> NodeStats:
        self._setup()
        fetch_thread = threading.Thread(target=self._fetch_loop, name="fetch", daemon=True)
        fetch_thread.start()
        last_beat = 0.0
        try:
            while not self._stop.is_set():
                if self.cfg.max_leases is not None and self.stats.leases >= self.cfg.max_leases:
                    break
                try:
                    worked = self.step()
                except CoordinatorError as e:
                    self.stats.last_error = e.reason
                    log.warning("coordinator refused: %s", e.reason)
                    if e.status == 403:  # banned or unknown: nothing more to do here
                        raise
                    worked = False
                if not worked:
                    t0 = time.perf_counter()
                    self._stop.wait(self.cfg.poll_interval_s)
                    self.stats.idle_seconds += time.perf_counter() - t0
                if time.time() - last_beat > self.cfg.heartbeat_interval_s:
                    last_beat = time.time()
                    self.client.heartbeat(self.stats.held_version, status="generating" if worked else "idle",
                                          idle_s=min(self.stats.idle_seconds, MAX_NODE_SECONDS),
                                          busy_s=min(self.stats.busy_seconds, MAX_NODE_SECONDS))
        finally:
            self._stop.set()
            fetch_thread.join(timeout=5)
            if self.engine is not None:
                self.engine.close()
            if self.swarm is not None:
                self.swarm.close()
        return self.stats

    def stop(self) -> None:
        self._stop.set()
