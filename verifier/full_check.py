"""The full check of groups: one prefill over every rollout, then replay, logprobs and activation proofs.

All groups passed here must have passed `verifier.checks.cheap_checks` (shapes, token ids, proofs decode) and
belong to one policy version, whose model is given. Their rollouts are recomputed together in as few forwards
as `max_batch_tokens` allows; then each group gets the first failure found (which check, which rollout, which
token, by how much), or None.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmrl.protocol import proofs as wire
from swarmrl.protocol.messages import PendingGroup
from swarmrl.verifier.config import Tolerances
from swarmrl.verifier.logprobs import LogprobResult, compare_logprobs_many
from swarmrl.verifier.models import PolicyModel
from swarmrl.verifier.prefill import recompute
from swarmrl.verifier.proofs import ProofStats, proof_errors_many
from swarmrl.verifier.replay import ReplayResult, replay_many


@dataclass
class GroupReport:
    """What the full check measured on one group (for logs, calibration and the bench)."""

    reason: str | None = None
    max_logprob_diff: float = 0.0
    max_replay_gap: float = 0.0
    replay_mismatches: int = 0
    proof_max_ulp: float = 0.0
    proof_mean_ulp: float = 0.0
    proof_checked: int = 0
    tokens: int = 0
    failures: list[str] = field(default_factory=list)
    """Every check that failed (reason holds the first)."""


def full_check(groups: list[PendingGroup], policy: PolicyModel, tol: Tolerances,
               max_batch_tokens: int = 16384) -> list[GroupReport]:
    """One report per group, in order."""
    seqs = [(g.group.prompt_ids, r.completion_ids) for g in groups for r in g.group.rollouts]
    recomputed = recompute(policy.model, seqs, policy.pad_id, max_batch_tokens)
    # Replay, logprobs and proofs of every rollout in one vectorised pass each; then judged group by group.
    rollouts = [(g, r) for g in groups for r in g.group.rollouts]
    logits = [rc.logits for rc in recomputed]
    tokens = [r.completion_ids for _, r in rollouts]
    temps = [g.sampling.temperature for g, _ in rollouts]
    replays = replay_many(logits, tokens, [r.seed for _, r in rollouts], temps)
    logprobs = compare_logprobs_many(logits, tokens, [r.logprobs for _, r in rollouts], temps)
    with_proof = [i for i, (_, r) in enumerate(rollouts) if r.proof is not None]
    stats = proof_errors_many([wire.decode(rollouts[i][1].proof) for i in with_proof],  # type: ignore[arg-type]
                              [recomputed[i].states for i in with_proof], tol.proof_boundary_rel)
    proof_stats: list[ProofStats | None] = [None] * len(rollouts)
    for i, ps in zip(with_proof, stats, strict=True):
        proof_stats[i] = ps
    reports = []
    k = 0
    for g in groups:
        n = len(g.group.rollouts)
        reports.append(_check_group(g, replays[k:k + n], logprobs[k:k + n], proof_stats[k:k + n], tol))
        k += n
    return reports


def _check_group(g: PendingGroup, replays: list[ReplayResult], logprobs: list[LogprobResult],
                 proof_stats: list[ProofStats | None], tol: Tolerances) -> GroupReport:
    rep = GroupReport()
    err_sum, checked = 0.0, 0
    for i, (r, rp, lp, ps) in enumerate(zip(g.group.rollouts, replays, logprobs, proof_stats, strict=True)):
        rep.tokens += len(r.completion_ids)
        rep.max_replay_gap = max(rep.max_replay_gap, rp.max_gap)
        rep.replay_mismatches += rp.mismatches
        if rp.max_gap > tol.tie_margin:
            rep.failures.append(f"replay: rollout {i} token {rp.worst_position} is not the token the seeded sampling "
                                f"rule picks (score gap {rp.max_gap:.3g} > tie margin {tol.tie_margin:g})")
        rep.max_logprob_diff = max(rep.max_logprob_diff, lp.max_abs_diff)
        if lp.max_abs_diff > tol.logprob_abs:
            rep.failures.append(f"logprobs: rollout {i} token {lp.worst_position} differs from the policy's by "
                                f"{lp.max_abs_diff:.3g} > {tol.logprob_abs:g}")
        if ps is not None:
            err_sum += ps.err_sum
            checked += ps.checked
            rep.proof_max_ulp = max(rep.proof_max_ulp, ps.max_err)
            if ps.max_err > tol.proof_max_ulp:
                rep.failures.append(f"activation proof: rollout {i} token {ps.worst_token} commits a value "
                                    f"{ps.max_err:.3g} fp16 ulps from the recomputed state (> {tol.proof_max_ulp:g})")
    rep.proof_checked = checked
    if checked:
        rep.proof_mean_ulp = err_sum / checked
        if rep.proof_mean_ulp > tol.proof_mean_ulp:
            rep.failures.append(f"activation proof: mean error {rep.proof_mean_ulp:.3g} fp16 ulps over {checked} "
                                f"entries exceeds {tol.proof_mean_ulp:g}")
    rep.reason = rep.failures[0] if rep.failures else None
    return rep
