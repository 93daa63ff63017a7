"""A node's work: lease prompts, generate their groups (with the engine's activation proofs), submit them signed.

Every lease's sampling seeds come from the coordinator. After the first, a node asks for its next lease with each
submission and gets it in the same answer (`next_lease`): one round trip per lease. A refusal of a submission is
counted and the work goes on, unless it refuses the node itself (`refusal.is_about_the_node`), which is raised
for the node's membership to deal with.

Pipelined (`WorkConfig.pipeline`), the engine does not wait on the network: a courier thread carries one request at
a time while the engine generates. A submission goes out on it (`hand_over`) while the next lease, already in hand,
is generated; its answer brings the lease after that one. To get one lease ahead, a lease is asked for in the
background (`prefetch`) while the first one is generated. Where the coordinator refuses the node a second lease in
flight (its admission allowance), prefetching pauses for PREFETCH_PAUSE_S and the work goes on one lease at a time,
as unpipelined. Whatever the courier's request raised (a refusal of the node itself) is raised in the caller's
thread at the next `settle`.

`Work` is built from `WorkConfig` (the node config's fields it reads) and talks to the coordinator through
`WorkClient`, the few calls it makes.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import httpx
from transformers import PreTrainedTokenizerBase

from swarmrl.models.prompts import render_prompt
from swarmrl.node.config import NodeConfig
from swarmrl.node.engine import GenerationRequest, InferenceEngine
from swarmrl.node.episodes import play_episodes
from swarmrl.node.inflight import Updates, generate_in_flight
from swarmrl.node.leasesize import LeaseSizer
from swarmrl.node.refusal import is_about_the_node
from swarmrl.node.stats import NodeStats
from swarmrl.protocol.episodes import Environment
from swarmrl.protocol.messages import Lease, LeaseRequest, Rollout, RolloutGroup, RolloutSubmission, SubmitResult
from swarmrl.protocol.overview import Training
from swarmrl.runtime.client import CoordinatorError
from swarmrl.runtime.retry import RetryPolicy

log = logging.getLogger("swarmrl.node")

# After the coordinator granted no lease ahead (admission, or no work), prefetching waits this long before trying
# again, so a node its allowance keeps at one lease asks once a minute, not once a lease.
PREFETCH_PAUSE_S = 60.0


class WorkClient(Protocol):
    """The coordinator calls a node's work makes (`runtime.client.CoordinatorClient` has them all): a lease, a
    submission (which may bring the next lease), and, when no work came, why (for the panel)."""

    def lease(self, max_prompts: int, held_version: int) -> Lease | None: ...

    def submit(self, submission: RolloutSubmission) -> SubmitResult: ...

    def training(self) -> Training: ...


@dataclass(frozen=True)
class WorkConfig:
    """The node config's fields the work reads."""

    max_prompts: int
    max_leases: int | None
    pipeline: bool = False

    @classmethod
    def from_node(cls, cfg: NodeConfig) -> WorkConfig:
        return cls(max_prompts=cfg.max_prompts, max_leases=cfg.max_leases, pipeline=cfg.pipeline)


class Work:
    """Leases, generation and submissions, counted in `stats`. `next_lease` is the lease granted with the last
    submission, not yet worked on."""

    def __init__(self, cfg: WorkConfig, client: WorkClient, stats: NodeStats, stop: threading.Event):
        self.cfg, self.client, self.stats, self._stop = cfg, client, stats, stop
        self.next_lease: Lease | None = None
        self.sizer = LeaseSizer(cfg.max_prompts)
        """How many prompts to ask for: what fits a share of a lease's time to live (`node.leasesize`)."""
        self._after_next: Lease | None = None  # a lease that came while `next_lease` was still in hand
        self._courier: ThreadPoolExecutor | None = None
        self._in_flight: Future[Lease | None] | None = None
        self._prefetch_after = 0.0  # monotonic time before which no lease is asked for ahead
        self.newer_ok = 0
        """How many versions the weights held may be past a lease's with in-flight updates (the run's max_staleness;
        a lease without them takes none)."""

    @property
    def done(self) -> bool:
        """Whether max_leases leases were taken."""
        return self.cfg.max_leases is not None and self.stats.leases >= self.cfg.max_leases

    def _wants_another(self) -> bool:
        """Whether a lease beyond those taken and the one in hand would still be worked on."""
        if self._stop.is_set():
            return False
        return self.cfg.max_leases is None or \
            self.stats.leases + (self.next_lease is not None) + (self._after_next is not None) < self.cfg.max_leases

    def lease_in_hand(self) -> Lease | None:
        """The lease that came with the last submission, taken out of `next_lease`; None when there is none or it
        expired (or is older than the weights held: never the case, as leases only move on)."""
        lease, self.next_lease, self._after_next = self.next_lease, self._after_next, None
        # With in-flight updates the weights may have moved past the lease's version while the lease waited in hand:
        # its groups are still taken when within max_staleness of it (`verifier.checks.check_versions`).
        newer_ok = self.newer_ok if lease is not None and lease.sampling.in_flight_updates else 0
        if lease is not None and (lease.expires_at <= time.time() or
                                  lease.policy_version + newer_ok < self.stats.held_version):
            return None
        return lease

    def ask(self) -> Lease | None:
        """A new lease, or None when the coordinator has none right now (it is then asked why, for the panel)."""
        lease = self.client.lease(self.sizer.ask(), held_version=self.stats.held_version)
        if lease is None:
            self.stats.ask_why_no_work(self.client, time.monotonic())
        else:
            self.sizer.saw_lease(lease.expires_at - time.time())
        return lease

    def generate(self, lease: Lease, engine: InferenceEngine, tokenizer: PreTrainedTokenizerBase,
                 env: Environment | None = None, updates: Updates | None = None) -> RolloutSubmission:
        """`lease`'s groups, generated by `engine` (holding policy version `stats.held_version`) with its seeds; with
        `env` (a multi-turn run's environment), each rollout a whole episode (`node.episodes`). With `updates` and a
        run with in-flight updates, a newer version may be loaded between decode steps (`node.inflight`): the groups
        then record their version spans, and the submission is of the oldest."""
        if env is not None:
            return self._episodes(lease, engine, tokenizer, env)
        requests, owners = [], []
        prompt_ids: dict[str, list[int]] = {}
        for p in lease.prompts:
            prompt_ids[p.prompt_id] = render_prompt(tokenizer, p.text)
            for seed in p.seeds:
                requests.append(GenerationRequest(prompt_ids=prompt_ids[p.prompt_id], seed=seed))
                owners.append(p.prompt_id)
        t0 = time.perf_counter()
        version, spans = self.stats.held_version, []
        if updates is not None and lease.sampling.in_flight_updates:
            completions, spans = generate_in_flight(engine, requests, lease.sampling.max_tokens,
                                                    lease.sampling.update_chunk_tokens, version, updates)
            version = spans[0][1]
        else:
            completions = engine.generate(requests, max_tokens=lease.sampling.max_tokens)
        gen_s = time.perf_counter() - t0
        self.stats.gen_seconds += gen_s
        self.sizer.observe(len(lease.prompts), gen_s)
        by_prompt: dict[str, list[Rollout]] = {p.prompt_id: [] for p in lease.prompts}
        for req, owner, c in zip(requests, owners, completions, strict=True):
            self.stats.tokens += len(c.token_ids)
            by_prompt[owner].append(Rollout(seed=req.seed, completion_ids=c.token_ids, logprobs=c.logprobs,
                                            finish_reason=c.finish_reason, proof=c.proof))
        groups = [RolloutGroup(prompt_id=pid, prompt_ids=prompt_ids[pid], rollouts=rs,
                               version_spans=_spans_of(spans, max(len(r.completion_ids) for r in rs)))
                  for pid, rs in by_prompt.items()]
        return RolloutSubmission(lease_id=lease.lease_id, policy_version=version, groups=groups, gen_seconds=gen_s)

    def _episodes(self, lease: Lease, engine: InferenceEngine, tokenizer: PreTrainedTokenizerBase,
                  env: Environment) -> RolloutSubmission:
        prompts = [(p.text, render_prompt(tokenizer, p.text), list(p.seeds)) for p in lease.prompts]
        t0 = time.perf_counter()
        played = play_episodes(engine, tokenizer, env, lease.sampling, prompts)
        gen_s = time.perf_counter() - t0
        self.stats.gen_seconds += gen_s
        self.sizer.observe(len(lease.prompts), gen_s)
        self.stats.tokens += sum(len(r.completion_ids) for rs in played for r in rs)
        groups = [RolloutGroup(prompt_id=p.prompt_id, prompt_ids=ids, rollouts=rs)
                  for p, (_, ids, _), rs in zip(lease.prompts, prompts, played, strict=True)]
        return RolloutSubmission(lease_id=lease.lease_id, policy_version=self.stats.held_version, groups=groups,
                                 gen_seconds=gen_s)

    def submit(self, submission: RolloutSubmission) -> None:
        """Submit, asking for the next lease in the same answer (unless stopping or at max_leases), and count the
        outcome. A refusal of the node itself is raised; any other refusal is counted and the work goes on."""
        self._keep(self._send(submission, self._wants_another()))

    def _send(self, submission: RolloutSubmission, ask_next: bool) -> Lease | None:
        """Submit (with `ask_next`, asking for the next lease in the same answer: one round trip fewer) and count the
        outcome; the lease that came with the answer."""
        if ask_next:
            submission.next_lease = LeaseRequest(max_prompts=self.sizer.ask(), held_version=self.stats.held_version)
        try:
            result = self.client.submit(submission)
        except CoordinatorError as e:
            self.stats.count_refused(submission, e)
            if is_about_the_node(e):
                raise  # the main loop stops, or registers again
            return None
        self.stats.count_result(submission, result)
        return result.next_lease

    # -- pipelined ---------------------------------------------------------------------------------------------------

    def hand_over(self, submission: RolloutSubmission) -> None:
        """Submit `submission`: unpipelined, now (`submit`); pipelined, on the courier once the request before it
        has settled (one in flight), returning at once."""
        if not self.cfg.pipeline:
            self.submit(submission)
            return
        self.settle()
        ask_next = self._wants_another()
        self._in_flight = self._courier_pool().submit(self._send, submission, ask_next)

    def prefetch(self) -> None:
        """Pipelined, with nothing in flight and no lease in hand: ask for the next lease in the background, so that
        it is in hand when the one being generated is done. Skipped for PREFETCH_PAUSE_S after one was not
        granted."""
        if not self.cfg.pipeline or self._in_flight is not None or self.next_lease is not None \
                or not self._wants_another() or time.monotonic() < self._prefetch_after:
            return
        self._in_flight = self._courier_pool().submit(self._ask_ahead)

    def _ask_ahead(self) -> Lease | None:
        """A lease ahead, asked for once: a full allowance's refusal (a 429 saying when a lease will expire) or an
        outage is not waited out here, as the submission behind it on the courier would wait too."""
        once = copy.copy(self.client)  # the same connection, run and key, without retries
        if hasattr(once, "retry"):
            once.retry = RetryPolicy(attempts=0)
        try:
            lease = once.lease(self.sizer.ask(), held_version=self.stats.held_version)
        except CoordinatorError as e:
            if is_about_the_node(e):
                raise
            log.debug("no lease ahead: %s", e.reason)
            lease = None
        except httpx.TransportError as e:
            log.debug("no lease ahead: %r", e)
            lease = None
        if lease is None:  # over the allowance, or no work: one lease at a time for a while
            self._prefetch_after = time.monotonic() + PREFETCH_PAUSE_S
        return lease

    def settle(self) -> None:
        """Wait for the courier's request in flight, if any, keeping the lease its answer brought (as `next_lease`,
        or after it when one is in hand already: a lease is never dropped, as it counts against the node's
        allowance until it expires) and raising what it raised."""
        future, self._in_flight = self._in_flight, None
        if future is None:
            return
        self._keep(future.result())

    def _keep(self, lease: Lease | None) -> None:
        """Keep a lease granted: as `next_lease`, or after it when one is in hand already."""
        if lease is not None:
            self.sizer.saw_lease(lease.expires_at - time.time())
            if self.next_lease is None:
                self.next_lease = lease
            else:
                self._after_next = lease

    def lease_ready(self) -> Lease | None:
        """The lease to work on next: the one in hand (`lease_in_hand`), or else the one the request in flight
        brings (waiting for it)."""
        lease = self.lease_in_hand()
        if lease is None and self._in_flight is not None:
            self.settle()
            lease = self.lease_in_hand()
        return lease

    def close(self) -> None:
        """Wait for the submission in flight (its outcome counted; a refusal of the node logged, as the node is
        stopping anyway), then end the courier."""
        try:
            self.settle()
        except Exception as e:  # stopping: nothing is left to do about it but say so
            log.warning("the last submission before stopping failed: %s", e)
        finally:
            if self._courier is not None:
                self._courier.shutdown(wait=True)
                self._courier = None

    def _courier_pool(self) -> ThreadPoolExecutor:
        if self._courier is None:
            self._courier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarmrl-courier")
        return self._courier


def _spans_of(spans: list[tuple[int, int]], longest: int) -> list[tuple[int, int]]:
    """The version spans of a group whose longest rollout has `longest` tokens: those that start within it; none
    when one version made all of it."""
    mine = [(a, v) for a, v in spans if a < longest]
    return mine if len(mine) > 1 else []
