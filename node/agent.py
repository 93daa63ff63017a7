"""The worker node: its three parts, built from the node config, and the loop that runs them.

A node's life has three parts, each in its own module, each built from the node config's fields it reads and
talking to the coordinator through a small client interface of its own:

- `node.membership`: join, register, the coordinator key it trusts, what it does about a refusal, receipts,
  heartbeats;
- `node.weights`: the fetch thread keeping the newest verified checkpoint, and its hand-over to the engine;
- `node.work`: lease, generate (with the engine's proofs), submit.

A node is left running for days: a coordinator that is down, restarting or unreachable is waited out (every
request is retried with backoff and jitter for as long as it takes, and the outage is logged once when it starts
and once when it ends), keeping the node's weights and identity; a coordinator that forgot the node (a new
database) is registered with again. Only a refusal that waiting cannot change stops it (`refusal.permanent`).
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import TYPE_CHECKING

import httpx
from transformers import PreTrainedTokenizerBase

from swarmrl.node.config import NodeConfig
from swarmrl.node.engine import InferenceEngine
from swarmrl.node.engines import build_engine
from swarmrl.node.membership import Membership, MembershipConfig
from swarmrl.node.metrics import node_families
from swarmrl.node.receipts import ReceiptBook
from swarmrl.node.refusal import PermanentRefusal, pinned_coordinator_key
from swarmrl.node.stats import NodeStats
from swarmrl.node.weights import EngineFactory, Weights, WeightsConfig
from swarmrl.node.work import Work, WorkConfig
from swarmrl.protocol.episodes import Environment, EnvironmentSpec, load_environment
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.messages import Lease, RolloutSubmission, RunInfo
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.runtime.metrics import registry_of, serve_metrics
from swarmrl.runtime.retry import RetryPolicy
from swarmrl.transfer.fetcher import CheckpointFetcher
from swarmrl.transfer.sources import ShardSource

if TYPE_CHECKING:
    from swarmrl.transfer.p2p.swarm import SwarmPeer

log = logging.getLogger("swarmrl.node")

__all__ = ["Node", "NodeStats", "PermanentRefusal", "pinned_coordinator_key"]


class Node:
    """One worker. `run()` loops until `stop()` or `max_leases`.

    Its parts are `membership`, `weights` and `work`. Its public steps are the seams tests and adversarial nodes
    build on: `join` (register, pin the key, set up fetching), `fetch_newer` (fetch the newest checkpoint),
    `load_ready_weights` (swap it into the engine), `wait_for_weights` (until the weights fit a lease), `generate`
    (a lease's groups), `step` (lease, generate and submit once). `engine_factory` builds the engine
    (`node.engines.build_engine` by default); `extra_sources` are shard sources tried besides the pool's."""

    def __init__(self, cfg: NodeConfig, extra_sources: list[ShardSource] | None = None, *,
                 engine_factory: EngineFactory = build_engine):
        self.cfg = cfg
        self.identity = Identity.load_or_create(cfg.key_path)
        self._stop = threading.Event()
        self.stats = NodeStats()
        # Every request waits out an outage of any length (until stop()); the outage is logged once per outage.
        client = CoordinatorClient(cfg.coordinator_url, self.identity, timeout=cfg.request_timeout_s,
                                   retry=RetryPolicy(attempts=None, cap_s=cfg.max_backoff_s), stop=self._stop,
                                   coordinator_key=cfg.coordinator_key)
        client.outage.context = partial(self.stats.outage_context, self.identity.node_id)
        self.membership = Membership(MembershipConfig.from_node(cfg), client, self.identity, self.stats, self._stop)
        self.weights = Weights(WeightsConfig.from_node(cfg), client, self.stats, self._stop,
                               engine_factory=engine_factory, extra_sources=extra_sources)
        self.work = Work(WorkConfig.from_node(cfg), client, self.stats, self._stop)
        self._env: tuple[EnvironmentSpec, Environment] | None = None
        self._client = client
        # Refused again and again (a full lease book, a coordinator shedding load): the main loop backs off.
        self._backoff = RetryPolicy(attempts=None, base_s=cfg.poll_interval_s, cap_s=cfg.max_backoff_s)

    # -- the parts' state, where tests and adversarial nodes reach it ---------------------------------------------

    @property
    def client(self) -> CoordinatorClient:
        """The client every part talks through (set it to give them all another)."""
        return self._client

    @client.setter
    def client(self, client: CoordinatorClient) -> None:
        self._client = self.membership.client = self.weights.client = self.work.client = client

    @property
    def coordinator_key(self) -> str:
        """The coordinator key trusted ("" until the first registration settles it, when none is configured)."""
        return self.membership.coordinator_key

    @property
    def _run_info(self) -> RunInfo | None:
        return self.membership.run

    @_run_info.setter
    def _run_info(self, run: RunInfo | None) -> None:
        self.membership.run = run

    @property
    def receipts(self) -> ReceiptBook | None:
        return self.membership.receipts

    @property
    def engine(self) -> InferenceEngine | None:
        return self.weights.engine

    @engine.setter
    def engine(self, engine: InferenceEngine | None) -> None:
        self.weights.engine = engine

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.weights.tokenizer

    @property
    def fetcher(self) -> CheckpointFetcher | None:
        return self.weights.fetcher

    @fetcher.setter
    def fetcher(self, fetcher: CheckpointFetcher | None) -> None:
        self.weights.fetcher = fetcher

    @property
    def swarm(self) -> SwarmPeer | None:
        return self.weights.swarm

    # -- the steps --------------------------------------------------------------------------------------------------

    def join(self) -> None:
        """Register with the pool, pin its key, join the checkpoint swarm if it has one, set up fetching.

        Only this first registration gives up, after join_timeout_s (when set), on a coordinator it cannot reach."""
        reg = self.membership.join()
        self.weights.open(self.membership.coordinator_key, reg.run)
        log.info("registered as %s with %s (run %s)", reg.node_id, self.cfg.coordinator_url, reg.run.run_id)

    def fetch_newer(self) -> None:
        """Fetch the coordinator's newest manifest if it is newer than anything held or ready."""
        self.weights.fetch_newer()

    def load_ready_weights(self, temperature: float, max_version: int | None = None) -> None:
        """Load the newest fetched checkpoint, if there is one (and, with `max_version`, if it is no newer)."""
        self.weights.load(temperature, max_version)

    def wait_for_weights(self, lease: Lease, max_staleness: int, temperature: float) -> None:
        """Wait (up to the lease's expiry) for weights recent enough that the lease's groups will be accepted, never
        loading weights newer than the lease's (`Weights.wait_once` says when waiting is hopeless)."""
        while self.weights.wait_once(lease, max_staleness):
            self.load_ready_weights(temperature, max_version=lease.policy_version)

    def generate(self, lease: Lease) -> RolloutSubmission:
        """`lease`'s groups, generated with the weights loaded (`Work.generate`)."""
        assert self.engine is not None and self.tokenizer is not None and self._run_info is not None
        run = self._run_info.spec  # in-flight updates: up to max_staleness versions past the one generation starts on
        updates = self.weights.in_flight(run.sampling.temperature, self.stats.held_version + run.max_staleness)
        return self.work.generate(lease, self.engine, self.tokenizer, self.environment(), updates=updates)

    def environment(self) -> Environment | None:
        """The run's environment (multi-turn runs), loaded once per run description; None for single-turn runs."""
        spec = None if self._run_info is None else self._run_info.spec.environment
        if spec is None:
            return None
        if self._env is None or self._env[0] != spec:
            self._env = (spec, load_environment(spec))
        return self._env[1]

    def step(self) -> bool:
        """Lease, generate and submit once (pipelined: `node.work`). False when there was no work."""
        assert self._run_info is not None
        run = self._run_info.spec
        lease = self.work.lease_ready()
        # Weights newer than a lease that came with the last submission wait for the next lease (groups from
        # weights newer than their lease's are refused, and their node banned).
        self.load_ready_weights(run.sampling.temperature, max_version=None if lease is None else lease.policy_version)
        if self.engine is None:
            self.work.next_lease = lease
            return False
        if lease is None:  # none came with the last submission (or this is the first)
            lease = self.work.ask()
            if lease is None:
                return False
        self.stats.count_lease()
        self.work.newer_ok = run.max_staleness
        self.work.prefetch()  # pipelined: the next lease is asked for while this one is generated
        self.wait_for_weights(lease, run.max_staleness, run.sampling.temperature)
        t0 = time.perf_counter()
        try:
            self.work.hand_over(self.generate(lease))  # pipelined: submitted while the next lease is generated
        finally:
            self.stats.busy_seconds += time.perf_counter() - t0
        return True

    # -- the loop ---------------------------------------------------------------------------------------------------

    def run(self) -> NodeStats:
        """Join, then lease, generate and submit until stop() or max_leases, serving metrics on `metrics_port`
        meanwhile. Raises PermanentRefusal when the pool refuses the node for good (its message says what to do)."""
        metrics = serve_metrics(registry_of(lambda: node_families(
            self.identity.node_id, self.cfg.name, self.stats, self.client.outage, self.weights.fetch_stats())),
            self.cfg.metrics_host, self.cfg.metrics_port)
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
        fetch_thread = self.weights.start()
        refusals = 0
        try:
            while not self._stop.is_set() and not self.work.done:
                try:
                    worked = self.step()
                    self.membership.keep_up(worked)
                    refusals = 0
                except CoordinatorError as e:
                    self.membership.refused(e)
                    worked, refusals = False, refusals + 1
                except httpx.TransportError:
                    if self._stop.is_set():  # a request given up because the node is stopping
                        break
                    raise
                if not worked:
                    t0 = time.perf_counter()
                    self._stop.wait(self._backoff.delay(refusals) if refusals else self.cfg.poll_interval_s)
                    self.stats.idle_seconds += time.perf_counter() - t0
        finally:
            self._stop.set()
            self.work.close()  # the submission in flight is answered and counted
            fetch_thread.join(timeout=5)
            self.weights.close()
        return self.stats

    def stop(self) -> None:
        self._stop.set()
