"""The verifier process: claim pending groups from the coordinator, check them, post verdicts.

Per batch, in group-id order:
1. the facts: the group is the one its node signed (`node_signature_problem`: one the coordinator's store, process or
   link changed is rejected without a ban, and logged loudly), the signed lease the group is judged against
   (`protocol.leases.lease_problem`: a prompt, seeds, sampling or version the coordinator did not sign for this node
   is rejected without a ban, since the node is not to blame), the weights of the group's policy version (a version
   the coordinator can no longer supply, or a missing proof, is rejected without a ban), then the cheap checks
   (`verifier.checks`; a failure bans); rewards come last (step 5): they can cost far more than the checks (a
   sandbox runs code);
2. the budget: an identity that has used its verifier time (`verifier.budget`: its full checks and the computing
   of its rewards, held groups' included) has its groups deferred: no verdict, no draw; the coordinator hands them
   out again later;
3. the draw (`verifier.policy`, the rule of `protocol.quarantine`, read with the number the coordinator drew at
   the group's first claim): warm-up, sampled or overflow full check, or hold (an accepted verdict with
   `checked=False`; the coordinator holds it until later checks vouch);
4. the full checks (`verifier.full_check`, early exit), by policy version: a failure bans. A full check that
   cannot be completed (a verifier error) is counted as failed and bans too: a check that was drawn must end in
   a verdict with consequences, or a node could make the checks it would fail disappear;
5. the rewards of each held group and each group that passed: recomputed from the completion (a claimed
   reward that differs bans; a non-finite one is refused without a ban).
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable

import httpx
import torch

from swarmrl.protocol import quarantine
from swarmrl.protocol.episodes import Environment, load_environment
from swarmrl.protocol.groupsig import verify_group
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.leases import lease_problem
from swarmrl.protocol.manifest import ManifestError
from swarmrl.protocol.messages import PendingGroup, Verdict
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.protocol.run import RunSpec, check_run
from swarmrl.protocol.signing import SignatureError
from swarmrl.protocol.tasks import Task, load_task
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.runtime.errors import UserError
from swarmrl.runtime.operator import not_an_operator, operator_identity
from swarmrl.verifier.budget import IdentityBudget
from swarmrl.verifier.checks import CheckContext, ProofLedger, cheap_checks, missing_proof, score
from swarmrl.verifier.config import VerifierConfig
from swarmrl.verifier.full_check import GroupReport, Staging, full_check
from swarmrl.verifier.metrics import VerifierStats, serve_verifier_metrics
from swarmrl.verifier.models import ModelCache, PolicyModel, VersionUnavailable
from swarmrl.verifier.policy import CheckPolicy

log = logging.getLogger("swarmrl.verifier")
MAX_REPORTS = 100_000

Item = tuple[PendingGroup, CheckContext, quarantine.Check]


class Verifier:
    def __init__(self, cfg: VerifierConfig, identity: Identity | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.identity = identity or operator_identity(cfg.key_path, "verifier")
        self.client = CoordinatorClient(cfg.coordinator_url, self.identity, coordinator_key=cfg.coordinator_key)
        self.client.outage.context = lambda: "the verifier checks groups once it answers (start the coordinator first)"
        self.task: Task | None = None
        self.env: Environment | None = None
        """The run's environment, which the checks replay multi-turn episodes with; None: a single-turn run."""
        rules = cfg.quarantine_rules()
        self.policy = CheckPolicy(rules)
        self._rng = random.SystemRandom() if cfg.policy_seed is None else random.Random(cfg.policy_seed + 1)
        self.staging = Staging(probe_tokens=cfg.probe_tokens, first_chunk_tokens=cfg.first_chunk_tokens,
                               chunk_growth=cfg.chunk_growth, logit_memory_mb=cfg.logit_memory_mb)
        self.budget = (IdentityBudget(cfg.identity_budget_s, cfg.identity_budget_window_s, clock)
                       if cfg.identity_budget_s is not None else None)
        self.source_budget = (IdentityBudget(cfg.source_budget_s, cfg.source_budget_window_s, clock)
                              if cfg.source_budget_s is not None else None)
        """Per source (`PendingGroup.node_source`), beside the per-identity `budget`."""
        self.ledger = ProofLedger()
        self.stats = VerifierStats()
        self.reports: dict[int, GroupReport] = {}
        """Full-check reports by group id, the most recent `MAX_REPORTS` (for logs, tests and the bench)."""
        self.models: ModelCache | None = None
        self.run_spec: RunSpec | None = None
        bound = quarantine.poisoned_share_bound(rules)
        log.info("check rule: K=%d p=%g h=%d; poisoned share at most %.4f with attackers holding %.2f of the "
                 "throughput (docs/quarantine.md)", rules.warmup_checks, rules.sample_rate, rules.max_held, bound,
                 quarantine.ATTACKER_SHARE)

    def _connect(self) -> None:
        info = self.client.info()
        key = self.cfg.coordinator_key or info.coordinator_key
        if self.cfg.coordinator_key and info.coordinator_key != self.cfg.coordinator_key:
            raise RuntimeError("the coordinator presents a different key than the one configured: refusing")
        try:
            check_run(info.spec, self.cfg.run, "verifier")
        except ValueError as e:
            raise UserError(f"{e}: remove the verifier's [run] table, or point it at that run's coordinator") from None
        self.run_spec = info.spec
        self.task = load_task(info.spec.task)
        self.env = None if info.spec.environment is None else load_environment(info.spec.environment)
        keep = max(self.cfg.keep_versions, info.spec.max_staleness + 1)  # a group may be that many versions old
        self.models = ModelCache(self.client, key, self.cfg.work_dir, keep=keep,
                                 dtype=getattr(torch, self.cfg.dtype), device=self.cfg.device, p2p=self.cfg.p2p,
                                 run=info)

    def _context(self, weights: PolicyModel) -> CheckContext:
        assert self.task is not None and self.run_spec is not None
        return CheckContext(tokenizer=weights.tokenizer, task=self.task, run=self.run_spec,
                            max_positions=weights.max_positions, hidden_size=weights.hidden_size,
                            stop_ids=weights.stop_ids, vocab_size=weights.vocab_size,
                            logprob_abs=self.cfg.tolerances.logprob_abs, proof_ledger=self.ledger, env=self.env)

    def verify(self, groups: list[PendingGroup]) -> list[Verdict]:
        """Verdicts for `groups`, in group-id order (so holds are applied before later passes vouch for them); a
        deferred group gets none."""
        if self.models is None:
            self._connect()
        assert self.models is not None
        verdicts: list[Verdict] = []
        passed: list[tuple[PendingGroup, CheckContext]] = []
        banned_here: set[str] = set()
        run = self.client.run
        assert run is not None
        for g in sorted(groups, key=lambda g: g.group_id):
            why = node_signature_problem(g, run.pool) or lease_problem(
                g.lease, g.node_id, g.group.prompt_id, run.coordinator_key, run.pool)
            if why is not None:
                verdicts.append(Verdict(group_id=g.group_id, accepted=False, reason=f"cannot verify: {why}"))
                continue
            if self._over_budget(g):  # deferred before any work on it; it keeps its draw: see verifier.budget
                self.stats.deferred += 1
                continue
            try:
                weights = self.models.get(g.policy_version)
            except VersionUnavailable as e:
                verdicts.append(Verdict(group_id=g.group_id, accepted=False, reason=f"cannot verify: {e}"))
                continue
            ctx = self._context(weights)
            if (reason := missing_proof(g, ctx)) is not None:
                verdicts.append(Verdict(group_id=g.group_id, accepted=False, reason=reason))
                continue
            t0 = time.perf_counter()
            try:
                reason, _ = cheap_checks(g, ctx, scored=False)
            except Exception as e:  # a bug here must not stop the verifier, nor pass the group
                log.exception("cheap checks of group %d crashed", g.group_id)
                verdicts.append(Verdict(group_id=g.group_id, accepted=False, reason=f"verifier error: {e!r}"[:500]))
                continue
            finally:  # a multi-turn episode's environment ran again here: the sender pays for it, as for rewards
                self._charge(g, time.perf_counter() - t0)
            if reason is not None:
                verdicts.append(Verdict(group_id=g.group_id, accepted=False, reason=reason, ban=True))
                banned_here.add(g.node_id)
            else:
                passed.append((g, ctx))
        # Nothing below may raise for one group without a verdict: every draw must end in one.
        full: dict[int, list[Item]] = defaultdict(list)
        held_here: Counter[str] = Counter()
        for g, ctx in passed:
            if g.node_id in banned_here:  # the ban drops it anyway: no draw, no check
                verdicts.append(Verdict(group_id=g.group_id, accepted=False,
                                        reason="not checked: another group of this node failed its checks"))
                continue
            check = self.policy.decide(g.node_checks_passed, g.node_held + held_here[g.node_id], g.draw)
            if check.full:
                full[g.policy_version].append((g, ctx, check))
            else:
                held_here[g.node_id] += 1
                verdicts.append(self._scored(g, ctx, check))
        for version, items in full.items():
            # In-flight updates: the later spans' versions too (the cache keeps max_staleness + 1 versions, all a
            # group may span, so loading them evicts none of these).
            later = sorted({v for g, _, _ in items for _, v in g.group.version_spans} - {version})
            try:
                weights = self.models.get(version)
                others = {v: self.models.get(v) for v in later}
            except (VersionUnavailable, ManifestError, OSError) as e:  # not the node's doing: no ban
                verdicts.extend(Verdict(group_id=g.group_id, accepted=False, reason=f"cannot verify: {e}")
                                for g, _, _ in items)
                continue
            verdicts.extend(self._full(weights, items, others))
        return sorted(verdicts, key=lambda v: v.group_id)

    def _over_budget(self, g: PendingGroup) -> bool:
        """Whether the group's sender, or its source, has spent its verifier time (`verifier.budget`)."""
        return ((self.budget is not None and self.budget.over(g.node_id)) or
                (self.source_budget is not None and bool(g.node_source) and self.source_budget.over(g.node_source)))

    def _charge(self, g: PendingGroup, seconds: float) -> None:
        if self.budget is not None:
            self.budget.charge(g.node_id, seconds)
        if self.source_budget is not None and g.node_source:
            self.source_budget.charge(g.node_source, seconds)

    def _scored(self, g: PendingGroup, ctx: CheckContext, check: quarantine.Check) -> Verdict:
        """The verdict of a group that is held or passed its full check: its trusted rewards decide the rest. The
        seconds rewarding takes are charged to the sender's budget, like its full checks."""
        t0 = time.perf_counter()
        try:
            rewards, reason, ban = score(g, ctx)
        except Exception as e:  # the task's bug; whatever the draw, this group would end here
            log.exception("rewarding group %d crashed", g.group_id)
            return Verdict(group_id=g.group_id, accepted=False, reason=f"verifier error: {e!r}"[:500])
        finally:
            # The sender chose the text the sandbox runs or the parser reads, so the seconds are its own.
            self._charge(g, time.perf_counter() - t0)
        if reason is not None:
            return Verdict(group_id=g.group_id, accepted=False, reason=reason, ban=ban)
        return Verdict(group_id=g.group_id, accepted=True, rewards=rewards, checked=check.full,
                       vouches=check.vouches)

    def _full(self, weights: PolicyModel, items: list[Item], others: dict[int, PolicyModel]) -> list[Verdict]:
        t0 = time.perf_counter()
        try:
            reports: list[GroupReport | None] = list(full_check(
                [g for g, _, _ in items], weights, self.cfg.tolerances, self.cfg.max_batch_tokens, self.staging,
                self._rng, others))
        except Exception:
            log.exception("batched full check crashed; checking its %d groups one by one", len(items))
            reports = [self._full_one(g, weights, others) for g, _, _ in items]
        self.stats.check_seconds += time.perf_counter() - t0
        out = []
        for (g, ctx, check), rep in zip(items, reports, strict=True):
            if rep is None:
                out.append(Verdict(group_id=g.group_id, accepted=False, ban=True,
                                   reason="the full check could not be completed (verifier error): counted as failed"))
                continue
            self.reports[g.group_id] = rep
            if len(self.reports) > MAX_REPORTS:
                del self.reports[next(iter(self.reports))]
            self._charge(g, rep.seconds)
            self.stats.full_checks += not rep.skipped
            self.stats.tokens_checked += rep.tokens
            if rep.skipped:  # its node failed another group here: the ban drops this one anyway
                out.append(Verdict(group_id=g.group_id, accepted=False, reason=rep.reason or "not checked"))
            elif rep.reason is None:
                out.append(self._scored(g, ctx, check))
            else:
                out.append(Verdict(group_id=g.group_id, accepted=False, reason=rep.reason, ban=True))
        return out

    def _full_one(self, g: PendingGroup, weights: PolicyModel, others: dict[int, PolicyModel]) -> GroupReport | None:
        try:
            return full_check([g], weights, self.cfg.tolerances, self.cfg.max_batch_tokens, self.staging,
                              self._rng, others)[0]
        except Exception:
            log.exception("full check of group %d crashed", g.group_id)
            return None

    def poll_once(self) -> int:
        """Claim, verify and post one batch of pending groups; returns how many were decided."""
        groups = self.client.pending(self.cfg.batch, wait_s=self.cfg.long_poll_s)
        if not groups:
            return 0
        verdicts = self.verify(groups)
        if verdicts:
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
                except CoordinatorError as e:
                    if e.code is RefusalCode.NOT_OPERATOR:  # no retry changes that
                        raise not_an_operator("verifier", self.cfg.key_path, self.identity,
                                              self.cfg.coordinator_url) from e
                    log.error("poll failed: %s", e)
                    self.stats.poll_errors += 1
                    worked = 0
                except (httpx.TransportError, ManifestError, OSError) as e:
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


def node_signature_problem(g: PendingGroup, pool: str) -> str | None:
    """Why `g` is not known to be what its node sent (its node signature, `protocol.groupsig`, does not verify for
    `pool`), or None. Not the node's doing: the coordinator's store or process, or its link, changed the group, so
    it is refused without a ban, and said loudly."""
    try:
        verify_group(g.group, node_key=g.node_key, node_id=g.node_id, lease_id=g.lease.lease_id,
                     policy_version=g.policy_version, pool=pool)
    except SignatureError as e:
        log.error("group %d of node %s is not the one its node signed (%s): refused without a ban; the coordinator "
                  "(its store or process) or its link changed it", g.group_id, g.node_id[:16], e.reason)
        return f"the group's node signature does not verify: {e.reason}"
    return None
