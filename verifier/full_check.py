"""The full check of groups: replay, logprobs and activation proofs against the verifier's own prefill, in stages
that stop as soon as a group has failed, so that garbage costs a small fraction of an honest check.

All groups passed here must have passed `verifier.checks.cheap_checks` (shapes, token ids, proofs decode) and
belong to one policy version, whose model is given. Stages (`Staging`):

1. probe: for each group, one rollout chosen at random (the node cannot know which) is recomputed over its
   prompt and its first `probe_tokens` completion tokens, and those tokens are checked. Random tokens, made-up
   logprobs or a proof of other states fail here, for about (prompt + probe) / (group size x (prompt +
   completion)) of an honest check: 2% for groups of 8 x 128 tokens.
2. chunks: all rollouts of the groups left, right-padded and batched up to `max_batch_tokens`, run through the
   model a span of columns at a time with its KV cache: the first span covers `first_chunk_tokens` completion
   tokens, each next one `chunk_growth` times more. After each span the new tokens are checked; the rows of a
   group that failed leave the batch (its node's other groups too: the ban drops them).

Each check runs on every token as it comes: replay (the token must be the seeded sample), logprobs (the claimed
one must be the policy's), and the activation proof (each committed entry within `proof_max_ulp`, the mean of
the group's compared entries within `proof_mean_ulp`: honest entries are each within half an ulp plus noise,
so any subset's mean is too). A group therefore fails at the earliest span that shows a failure, and fails
exactly when the whole check would have failed: stopping early changes what the report lists, never the
verdict. `Staging(early_exit=False)` checks everything of every group (calibration, and the byzantine suite's
account of which layer catches which attack).

In-flight updates (`RolloutGroup.version_spans`): a group whose tokens come from several versions is checked once
per version, with that version's model, on the tokens of that version's spans only (the prefill runs over the
prompt and every token before them, so each token is judged by the very logits that chose it). A span whose
claimed version is not the one that generated it fails replay, logprobs and proof like any other forgery.

Memory: logits exist only for the positions being scored, at most `logit_memory_mb` of float64 [positions,
vocab] at a time; the final hidden states ([tokens, hidden]) of a rollout are kept for its proof.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from swarmrl.models.head import head_of
from swarmrl.protocol import proofs as wire
from swarmrl.protocol.episodes import model_spans
from swarmrl.protocol.messages import PendingGroup
from swarmrl.protocol.sampling import replay_tokens, turn_seed
from swarmrl.verifier.config import Tolerances
from swarmrl.verifier.models import PolicyModel
from swarmrl.verifier.prefill import ChunkedPrefill, length_batches
from swarmrl.verifier.proofs import proof_errors_many

_TEMPORARIES = 6
"""[positions, vocab] tensors of 8 bytes each reserved per row while scoring. Since the two-level sampling rule
(protocol.sampling.replay_tokens) only the logits and their scaled float32 copy are of vocabulary size: a
conservative bound, kept so that the rows per call are unchanged."""


@dataclass(frozen=True)
class Staging:
    """How the full check proceeds (see the module docstring); VerifierConfig sets it."""

    probe_tokens: int = 16
    first_chunk_tokens: int = 16
    chunk_growth: int = 2
    logit_memory_mb: int = 256
    early_exit: bool = True


@dataclass
class GroupReport:
    """What the full check measured on one group (for logs, calibration, the bench and the budget)."""

    reason: str | None = None
    max_logprob_diff: float = 0.0
    max_replay_gap: float = 0.0
    replay_mismatches: int = 0
    proof_max_ulp: float = 0.0
    proof_mean_ulp: float = 0.0
    proof_checked: int = 0
    tokens: int = 0
    """Completion tokens checked."""
    failures: list[str] = field(default_factory=list)
    """Every check that failed on what was checked (reason holds the first)."""
    stage: str = ""
    """Where the verdict was reached: 'probe', 'chunk <k>' (failed there), 'complete' (passed) or 'skipped'."""
    prefill_tokens: int = 0
    """Tokens (not padding) this group put through the model."""
    seconds: float = 0.0
    """Its share of the check's wall time (by prefill tokens)."""
    skipped: bool = False
    """Not checked: another group of the same node failed first in this call."""


@dataclass
class _Rollout:
    group: int
    index: int
    prompt: list[int]
    tokens: list[int]
    claimed: list[float]
    seed: int
    temperature: float
    proof: wire.Proof | None
    turns: list[int] = field(default_factory=list)
    """Turn lengths of a multi-turn episode (`protocol.episodes`); empty: one model turn."""
    windows: list[tuple[int, int]] | None = None
    """The token ranges [a, b) checked (those of one version's spans); None: every token."""
    max_gap: float = 0.0
    gap_pos: int = 0
    mismatches: int = 0
    max_lp: float = 0.0
    lp_pos: int = 0
    proof_max: float = 0.0
    proof_worst: int = 0
    proof_sum: float = 0.0
    proof_checked: int = 0
    scored: int = 0

    def fresh(self, n: int | None = None) -> _Rollout:
        """The same rollout, nothing scored, its completion cut to `n` tokens (the probe)."""
        k = len(self.tokens) if n is None else min(n, len(self.tokens))
        return _Rollout(self.group, self.index, self.prompt, self.tokens[:k], self.claimed[:k], self.seed,
                        self.temperature, self.proof, self.turns, self.windows)

    def model_pieces(self, a: int, b: int) -> list[tuple[int, int, int, int, int]]:
        """The model-sampled stretches of tokens a..b-1: (start, end, seed, position of start within its turn, index
        of start among the model's tokens, where the proof has it). Environment tokens are in none: they are
        replayed by `models.episodes.episode_problem`, not sampled."""
        out, before = [], 0
        for k, (s, e) in enumerate(model_spans(self.turns, len(self.tokens))):
            for wa, wb in self.windows if self.windows is not None else [(s, e)]:
                lo, hi = max(a, s, wa), min(b, e, wb)
                if lo < hi:
                    out.append((lo, hi, turn_seed(self.seed, k), lo - s, before + lo - s))
            before += e - s
        return out


def full_check(groups: list[PendingGroup], policy: PolicyModel, tol: Tolerances, max_batch_tokens: int = 16384,
               staging: Staging | None = None, rng: random.Random | None = None,
               others: Mapping[int, PolicyModel] | None = None) -> list[GroupReport]:
    """One report per group, in order. Groups whose tokens span several versions (in-flight updates) need the model
    of each: `policy` is that of the groups' policy_version, `others` those of the later spans' versions."""
    staging = staging or Staging()
    rng = rng or random.SystemRandom()
    reports = [GroupReport() for _ in groups]
    rollouts = [[_Rollout(gi, i, g.group.prompt_ids, r.completion_ids, r.logprobs, r.seed, g.sampling.temperature,
                          wire.decode(r.proof) if r.proof is not None else None, list(r.turns))
                 for i, r in enumerate(g.group.rollouts)] for gi, g in enumerate(groups)]
    nodes, failed_nodes = [g.node_id for g in groups], set[str]()
    if all(len(g.group.version_spans) <= 1 for g in groups):
        _check(_Run(policy, tol, staging, max_batch_tokens, reports, nodes, failed_nodes), rollouts, rng)
    else:
        models = {g.policy_version: policy for g in groups} | dict(others or {})
        spans = [_windows(g) for g in groups]
        for v in sorted({v for by_version in spans for v in by_version}):
            if v not in models:
                raise ValueError(f"a group has a span of version {v}, but no model of that version was given")
            part = [GroupReport() for _ in groups]
            mine = [[_Rollout(**{**r.__dict__, "windows": w}).fresh(w[-1][1]) for r in rs
                     if (w := spans[gi].get(v)) and len(r.tokens) > w[0][0]] for gi, rs in enumerate(rollouts)]
            _check(_Run(models[v], tol, staging, max_batch_tokens, part, nodes, failed_nodes), mine, rng)
            for whole, one in zip(reports, part, strict=True):
                _merge(whole, one, v)
    for rep in reports:
        if not rep.stage:
            rep.stage = "complete"
        rep.reason = rep.failures[0] if rep.failures else ("not checked: another group of this node failed its "
                                                           "full check first" if rep.skipped else None)
    return reports


def _check(run: _Run, rollouts: list[list[_Rollout]], rng: random.Random) -> None:
    """The stages (probe, then chunks) over these rollouts, per group (a group may have none)."""
    if run.staging.early_exit and run.staging.probe_tokens > 0:
        probes = [[rs[rng.randrange(len(rs))].fresh(run.staging.probe_tokens)] if rs else [] for rs in rollouts]
        run.stage(probes, "probe", single_span=True)
    run.stage([[r.fresh() for r in rs] for rs in rollouts], "chunk", single_span=False)


def _windows(g: PendingGroup) -> dict[int, list[tuple[int, int]]]:
    """Per version, the token ranges [a, b) of its spans (`RolloutGroup.version_spans`)."""
    spans = g.group.span_versions(g.policy_version)
    out: dict[int, list[tuple[int, int]]] = {}
    for (a, v), (b, _) in zip(spans, spans[1:] + [(2**62, -1)], strict=True):
        out.setdefault(v, []).append((a, b))
    return out


def _merge(whole: GroupReport, part: GroupReport, version: int) -> None:
    """Add what one version's check of a group measured to the group's report."""
    if part.failures and not whole.failures:
        whole.stage = f"version {version} {part.stage}"
    whole.failures += [f"version {version} span: {f}" for f in part.failures]
    checked = whole.proof_checked + part.proof_checked
    if checked:
        whole.proof_mean_ulp = (whole.proof_mean_ulp * whole.proof_checked +
                                part.proof_mean_ulp * part.proof_checked) / checked
    whole.proof_checked = checked
    whole.max_logprob_diff = max(whole.max_logprob_diff, part.max_logprob_diff)
    whole.max_replay_gap = max(whole.max_replay_gap, part.max_replay_gap)
    whole.proof_max_ulp = max(whole.proof_max_ulp, part.proof_max_ulp)
    whole.replay_mismatches += part.replay_mismatches
    whole.tokens += part.tokens
    whole.prefill_tokens += part.prefill_tokens
    whole.seconds += part.seconds
    if part.skipped and not whole.failures:
        whole.skipped, whole.stage = True, "skipped"


@dataclass(frozen=True)
class _Piece:
    """Tokens a..b-1 of rollout `r`, all of one model turn, with the states that chose them."""

    r: _Rollout
    a: int
    b: int
    states: torch.Tensor
    seed: int
    """The seed of their turn (`protocol.sampling.turn_seed`)."""
    pos: int
    """Token a's position within its turn (the sampling rule's position)."""
    at: int
    """Token a's index among the rollout's model tokens (the proof's)."""


class _Run:
    """One call's state: the reports, which groups have failed and which nodes."""

    def __init__(self, policy: PolicyModel, tol: Tolerances, staging: Staging, max_batch_tokens: int,
                 reports: list[GroupReport], nodes: list[str], failed_nodes: set[str]):
        self.policy, self.tol, self.staging, self.max_batch_tokens = policy, tol, staging, max_batch_tokens
        self.reports, self.nodes = reports, nodes
        self.failed_nodes = failed_nodes
        """Nodes that failed a group in this call (shared by the calls of each version)."""
        vocab = policy.model.get_output_embeddings().weight.shape[0]
        self.rows_per_call = max(1, (staging.logit_memory_mb << 20) // (vocab * 8 * _TEMPORARIES))

    def done(self, gi: int) -> bool:
        """Whether group gi needs no more checking (decided, or its node failed elsewhere with early exit)."""
        rep = self.reports[gi]
        if not self.staging.early_exit:
            return False
        if rep.failures or rep.skipped:
            return True
        if self.nodes[gi] in self.failed_nodes:
            rep.skipped, rep.stage = True, "skipped"
            return True
        return False

    def stage(self, per_group: list[list[_Rollout]], name: str, single_span: bool) -> None:
        """Check these rollouts (per group), batched by length, span by span."""
        live = [r for gi, rs in enumerate(per_group) if not self.done(gi) for r in rs]
        if not live:
            return
        lengths = [len(r.prompt) + len(r.tokens) - 1 for r in live]
        for batch in length_batches(lengths, self.max_batch_tokens):
            items = [live[i] for i in batch if not self.done(live[i].group)]
            if items:
                self._batch(items, per_group, name, single_span)

    def _batch(self, items: list[_Rollout], per_group: list[list[_Rollout]], name: str, single_span: bool) -> None:
        pf = ChunkedPrefill(self.policy.model, [r.prompt + r.tokens[:-1] for r in items], self.policy.pad_id)
        longest_prompt = max(len(r.prompt) for r in items)
        size = self.staging.first_chunk_tokens
        end = pf.width if single_span else longest_prompt - 1 + size
        k = 0
        while pf.rows and pf.done < pf.width:
            start = pf.done
            t0 = time.perf_counter()
            hidden = pf.advance(end)
            pieces = []
            for row, r in enumerate(items[j] for j in pf.rows):
                p0 = len(r.prompt) - 1
                a, b = max(0, start - p0), min(len(r.tokens), pf.done - p0)
                for lo, hi, seed, pos, at in r.model_pieces(a, b):
                    pieces.append(_Piece(r, lo, hi, hidden[row, p0 + lo - start:p0 + hi - start], seed, pos, at))
            self._score(pieces)
            seconds = time.perf_counter() - t0
            real = pf.real_tokens(start, pf.done)
            total = max(sum(real.values()), 1)
            for j, n in real.items():
                rep = self.reports[items[j].group]
                rep.prefill_tokens += n
                rep.seconds += seconds * n / total
            label = name if name == "probe" else f"{name} {k}"
            for gi in sorted({p.r.group for p in pieces}):
                self._judge(gi, per_group[gi], label)
            if self.staging.early_exit:
                pf.keep([j for j in pf.rows if not self.done(items[j].group)])
            k += 1
            size *= self.staging.chunk_growth
            end = pf.done + size

    @torch.inference_mode()
    def _score(self, pieces: list[_Piece]) -> None:
        """Replay, logprobs and proof entries of each piece (model-sampled tokens a..b-1 of a rollout, their
        states)."""
        if not pieces:
            return
        head = head_of(self.policy.model)  # the model's own logits: softcapping, scales, ... are its business
        states = torch.cat([p.states for p in pieces])
        tokens = torch.tensor([t for p in pieces for t in p.r.tokens[p.a:p.b]], dtype=torch.long)
        claimed = torch.tensor([c for p in pieces for c in p.r.claimed[p.a:p.b]], dtype=torch.float64)
        seeds = torch.tensor([p.seed for p in pieces for _ in range(p.a, p.b)], dtype=torch.int64)
        positions = torch.tensor([p.pos + i for p in pieces for i in range(p.b - p.a)], dtype=torch.int64)
        temps = torch.tensor([p.r.temperature for p in pieces for _ in range(p.a, p.b)], dtype=torch.float64)
        gaps = torch.empty(len(tokens), dtype=torch.float64)
        diffs = torch.empty(len(tokens), dtype=torch.float64)
        step = self.rows_per_call
        for i in range(0, len(tokens), step):
            sl = slice(i, i + step)
            logits = head(states[sl]).float()
            replayed = replay_tokens(logits, tokens[sl], seeds[sl], positions[sl], temps[sl])
            gaps[sl] = replayed.gaps.cpu()
            diffs[sl] = torch.nan_to_num((claimed[sl] - replayed.logprobs.cpu()).abs(), nan=float("inf"))
            del logits, replayed
        with_proof = [k for k, p in enumerate(pieces) if p.r.proof is not None]
        stats = proof_errors_many([pieces[k].r.proof for k in with_proof],  # type: ignore[misc]
                                  [pieces[k].states for k in with_proof], self.tol.proof_boundary_rel,
                                  starts=[pieces[k].at for k in with_proof])
        proof_stats = dict(zip(with_proof, stats, strict=True))
        off = 0
        for k, (r, a, b) in enumerate((p.r, p.a, p.b) for p in pieces):
            g, d = gaps[off:off + b - a], diffs[off:off + b - a]
            off += b - a
            gi, di = int(g.argmax()), int(d.argmax())
            if g[gi] > r.max_gap or r.scored == 0:
                r.max_gap, r.gap_pos = float(g[gi]), a + gi
            if d[di] > r.max_lp or r.scored == 0:
                r.max_lp, r.lp_pos = float(d[di]), a + di
            r.mismatches += int((g > 0).sum())
            r.scored += b - a
            if (ps := proof_stats.get(k)) is not None:
                r.proof_sum += ps.err_sum
                r.proof_checked += ps.checked
                if ps.max_err > r.proof_max:
                    r.proof_max, r.proof_worst = ps.max_err, ps.worst_token

    def _judge(self, gi: int, rollouts: list[_Rollout], stage: str) -> None:
        """Fill group gi's report from what its rollouts have scored; mark it failed at `stage` if it fails."""
        tol, rep = self.tol, self.reports[gi]
        failures = []
        err_sum, checked = 0.0, 0
        for r in rollouts:
            if not r.scored:
                continue
            if r.max_gap > tol.tie_margin:
                failures.append(f"replay: rollout {r.index} token {r.gap_pos} is not the token the seeded sampling "
                                f"rule picks (score gap {r.max_gap:.3g} > tie margin {tol.tie_margin:g})")
            if r.max_lp > tol.logprob_abs:
                failures.append(f"logprobs: rollout {r.index} token {r.lp_pos} differs from the policy's by "
                                f"{r.max_lp:.3g} > {tol.logprob_abs:g}")
            if r.proof_max > tol.proof_max_ulp:
                failures.append(f"activation proof: rollout {r.index} token {r.proof_worst} commits a value "
                                f"{r.proof_max:.3g} fp16 ulps from the recomputed state (> {tol.proof_max_ulp:g})")
            err_sum += r.proof_sum
            checked += r.proof_checked
        mean = err_sum / checked if checked else 0.0
        if mean > tol.proof_mean_ulp:
            failures.append(f"activation proof: mean error {mean:.3g} fp16 ulps over {checked} entries exceeds "
                            f"{tol.proof_mean_ulp:g}")
        scored = [r for r in rollouts if r.scored]
        rep.tokens = sum(r.scored for r in scored)
        rep.max_replay_gap = max((r.max_gap for r in scored), default=0.0)
        rep.max_logprob_diff = max((r.max_lp for r in scored), default=0.0)
        rep.replay_mismatches = sum(r.mismatches for r in scored)
        rep.proof_max_ulp = max((r.proof_max for r in scored), default=0.0)
        rep.proof_mean_ulp, rep.proof_checked = mean, checked
        if failures and not rep.stage:
            rep.stage = stage
            self.failed_nodes.add(self.nodes[gi])
        rep.failures = failures
