"""The verifier process: claim pending groups from the coordinator, check them, post verdicts.

Per group: the cheap checks (`verifier.checks`) always; then either the full check (`verifier.full_check`:
prefill with the weights of the group's policy version, replay, logprobs, activation proof) or, when the
policy (`verifier.policy`) samples it out, an accepted verdict with `checked=False` that the coordinator holds
until a later full check of the same node passes. Any failed check rejects the group and bans its node.
A group whose weights the coordinator can no longer supply, or that lacks a required proof, is rejected
without a ban.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import httpx
import torch

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.manifest import ManifestError
from swarmrl.protocol.messages import PendingGroup, Verdict
from swarmrl.protocol.run import RunSpec, check_run
from swarmrl.protocol.tasks import Task, load_task
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.verifier.checks import CheckContext, cheap_checks, missing_proof
from swarmrl.verifier.config import VerifierConfig
from swarmrl.verifier.full_check import GroupReport, full_check
from swarmrl.verifier.metrics import VerifierStats, serve_verifier_metrics
from swarmrl.verifier.models import ModelCache, PolicyModel, VersionUnavailable
from swarmrl.verifier.policy import CheckPolicy

log = logging.getLogger("swarmrl.verifier")
MAX_REPORTS = 100_000


class Verifier:
    def __init__(self, cfg: VerifierConfig, identity: Identity | None = None):
        self.cfg = cfg
        self.identity = identity or Identity.load_or_create(cfg.key_path)
        self.client = CoordinatorClient(cfg.coordinator_url, self.identity)
        self.task: Task | None = None
        self.policy = CheckPolicy(cfg.warmup_checks, cfg.sample_rate, cfg.policy_seed)
        self.stats = VerifierStats()
        self.reports: dict[int, GroupReport] = {}
        """Full-check reports by group id, the most recent `MAX_REPORTS` (for logs, tests and the bench)."""
        self.models: ModelCache | None = None
        self.run_spec: RunSpec | None = None

    # kept for callers of the first cut
    @property
    def checked(self) -> int:
        return self.stats.groups

    @property
    def rejected(self) -> int:
        return self.stats.rejected

    def _connect(self) -> None:
        info = self.client.info()
        key = self.cfg.coordinator_key or info.coordinator_key
        if self.cfg.coordinator_key and info.coordinator_key != self.cfg.coordinator_key:
            raise RuntimeError("the coordinator presents a different key than the one configured: refusing")
        check_run(info.spec, self.cfg.run, "verifier")
        self.run_spec = info.spec
        self.task = load_task(info.spec.task)
        keep = max(self.cfg.keep_versions, info.spec.max_staleness + 1)  # a group may be that many versions old
        self.models = ModelCache(self.client, key, self.cfg.work_dir, keep=keep,
                                 dtype=getattr(torch, self.cfg.dtype), device=self.cfg.device, p2p=self.cfg.p2p,
                                 run=info)

    def _context(self, weights: PolicyModel) -> CheckContext:
        assert self.task is not None and self.run_spec is not None
        return CheckContext(tokenizer=weights.tokenizer, task=self.task, run=self.run_spec,
                            max_positions=weights.max_positions, hidden_size=weights.hidden_size,
                            stop_ids=weights.stop_ids, vocab_size=weights.vocab_size)

    def verify(self, groups: list[PendingGroup]) -> list[Verdict]:
        """Verdicts for `groups` (in group-id order, so holds are applied before later passes release them)."""
        if self.models is None:
            self._connect()
        assert self.models is not None
        verdicts: list[Verdict] = []
        full: dict[int, list[tuple[PendingGroup, list[float]]]] = defaultdict(list)
        for g in sorted(groups, key=lambda g: g.group_id):
            try:
                weights = self.models.get(g.policy_version)
            except VersionUnavailable as e:
                verdicts.append(Verdict(group_id=g.group_id, accepted=False, reason=f"cannot verify: {e}"))
                continue
            ctx = self._context(weights)
            if (reason := missing_proof(g, ctx)) is not None:
                verdicts.append(Verdict(group_id=g.group_id, accepted=False, reason=reason))
                continue
            try:
                reason, rewards = cheap_checks(g, ctx)
            except Exception as e:  # a bug here must not stop the verifier, nor pass the group
                log.exception("cheap checks of group %d crashed", g.group_id)
                verdicts.append(Verdict(group_id=g.group_id, accepted=False, reason=f"verifier error: {e!r}"[:500]))
                continue
            if reason is not None:
                verdicts.append(Verdict(group_id=g.group_id, accepted=False, reason=reason, ban=True))
            elif self.policy.wants_full_check(g.node_id, g.node_checks_passed):
                full[g.policy_version].append((g, rewards))
            else:
                verdicts.append(Verdict(group_id=g.group_id, accepted=True, rewards=rewards, checked=False))
        for version, items in full.items():
            verdicts.extend(self._full(self.models.get(version), items))
        return sorted(verdicts, key=lambda v: v.group_id)

    def _full(self, weights: PolicyModel, items: list[tuple[PendingGroup, list[float]]]) -> list[Verdict]:
        t0 = time.perf_counter()
        try:
            reports = full_check([g for g, _ in items], weights, self.cfg.tolerances, self.cfg.max_batch_tokens)
        except Exception:
            log.exception("batched full check crashed; checking its %d groups one by one", len(items))
            reports = [self._full_one(g, weights) for g, _ in items]
        self.stats.check_seconds += time.perf_counter() - t0
        out = []
        for (g, rewards), rep in zip(items, reports, strict=True):
            if rep is None:
                out.append(Verdict(group_id=g.group_id, accepted=False, reason="verifier error during the full check"))
                continue
            self.reports[g.group_id] = rep
            if len(self.reports) > MAX_REPORTS:
                del self.reports[next(iter(self.reports))]
            self.stats.full_checks += 1
            self.stats.tokens_checked += rep.tokens
            if rep.reason is None:
                self.policy.record_pass(g.node_id, g.node_checks_passed)
                out.append(Verdict(group_id=g.group_id, accepted=True, rewards=rewards))
            else:
                out.append(Verdict(group_id=g.group_id, accepted=False, reason=rep.reason, ban=True))
        return out

    def _full_one(self, g: PendingGroup, weights: PolicyModel) -> GroupReport | None:
        try:
            return full_check([g], weights, self.cfg.tolerances, self.cfg.max_batch_tokens)[0]
        except Exception:
            log.exception("full check of group %d crashed", g.group_id)
            return None

    def poll_once(self) -> int:
        """Claim, verify and post one batch of pending groups; returns how many were decided."""
        groups = self.client.pending(self.cfg.batch, wait_s=self.cfg.long_poll_s)
        if not groups:
            return 0
        verdicts = self.verify(groups)
        self.client.verdicts(verdicts)
        self.stats.groups += len(verdicts)
        for v in verdicts:
            if not v.accepted:
                self.stats.rejected += 1
                self.stats.bans += int(v.ban)
                log.warning("group %d rejected%s: %s", v.group_id, " (node banned)" if v.ban else "", v.reason)
            elif not v.checked:
                self.stats.held += 1
        return len(verdicts)

    def run(self, stop_after_s: float | None = None) -> None:
        """Poll until `stop_after_s` (forever by default). Coordinator errors and unreachable or inconsistent
        weights are logged and retried: claimed groups left without a verdict are claimed again later."""
        t0 = time.time()
        metrics = serve_verifier_metrics(self.stats, self.cfg.metrics_host, self.cfg.metrics_port)
        try:
            while stop_after_s is None or time.time() - t0 < stop_after_s:
                t_poll = time.monotonic()
                try:
                    worked = self.poll_once()
                except (CoordinatorError, httpx.TransportError, ManifestError, OSError) as e:
                    log.error("poll failed: %s", e)
                    self.stats.poll_errors += 1
                    worked = 0
                if worked == 0 and time.monotonic() - t_poll < self.cfg.poll_interval_s:
                    time.sleep(self.cfg.poll_interval_s)  # the coordinator did not hold the poll: do not spin
        finally:
            if metrics is not None:
                metrics.close()
            if self.models is not None:
                self.models.close()  # leaves the checkpoint swarm, if it joined one
