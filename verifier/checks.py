"""The cheap checks every group gets: facts only the trusted side knows, and the trusted reward.

- prompt tokens must be the leased prompt's, seeds the leased seeds, every token id in the vocabulary;
- prompt tokens as `models.prompts.render_prompt` makes them (the chat template when the tokenizer has one);
- termination: a stop token (any of the model's) only at the end and exactly when "stop"; "length" only at
  max_tokens or at the model's length limit; no completion longer than max_tokens; in a multi-turn run, the same
  for each model turn, and every environment turn exactly what the run's environment answers
  (`models.episodes.episode_problem`);
- versions: generated with a version no newer than the lease's and within the pool's staleness bound;
- logprobs finite and <= 0, and equal (within twice the logprob tolerance) wherever two rollouts of the group
  share the tokens up to and including that position: the policy gives a prefix one logprob, whatever seed
  sampled it;
- a claimed reward, if any, must be the trusted one; a proof, when required, must decode with the pool's
  parameters (a malformed proof is rejected, never a crash; a missing one is refused without a ban);
- a proof commits the states of the prompt and the completion but its last token: the same proof text under
  other such tokens, in one group or anywhere in the node's recent groups (`ProofLedger`), is a copied proof.
  Only the node's own groups are compared, so no node can be framed by another submitting a proof first.

The reward is recomputed here (`score`) from the decoded completion, never taken from the node. The checks
cost microseconds per group; a reward may cost much more (a task can run code in a sandbox), so the verifier
scores only groups it holds or that passed their full check. The prefill-based checks are in
`verifier.full_check`.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from swarmrl.models.episodes import Episode, episode_problem, last_model_turn
from swarmrl.models.prompts import render_prompt
from swarmrl.protocol import proofs
from swarmrl.protocol.episodes import Environment, model_spans
from swarmrl.protocol.messages import PendingGroup
from swarmrl.protocol.run import RunSpec
from swarmrl.protocol.tasks import Scored, Task
from swarmrl.protocol.validation import group_problem, staleness_problem, version_spans_problem

REWARD_CLAIM_TOL = 1e-6


@dataclass
class CheckContext:
    tokenizer: PreTrainedTokenizerBase
    task: Task
    run: RunSpec
    """The run's description (staleness bound, proof parameters), as the coordinator serves it."""
    max_positions: int | None = None
    """The model's length limit (prompt + completion); None: not known, only max_tokens ends a completion."""
    hidden_size: int | None = None
    stop_ids: frozenset[int] = frozenset()
    """The model's stop tokens (`PolicyModel.stop_ids`); empty: the tokenizer's eos only."""
    vocab_size: int | None = None
    """Rows of the model's logits; None: the tokenizer's size."""
    logprob_abs: float | None = None
    """The full check's logprob tolerance; claims of a shared prefix may differ by twice it. None: not compared."""
    proof_ledger: ProofLedger | None = None
    """Proofs the node sent recently (None: only the group itself is compared)."""
    env: Environment | None = None
    """The run's environment (multi-turn runs): every episode's environment turns are replayed with it."""

    def episode(self, g: PendingGroup, prompt_len: int) -> Episode:
        """What `g`'s episodes were played in (`models.episodes`)."""
        assert self.env is not None
        return Episode(self.env, self.tokenizer, g.sampling, self.stop_ids or frozenset({self.tokenizer.eos_token_id}),
                       g.prompt_text, prompt_len, self.max_positions)


def check_versions(g: PendingGroup, ctx: CheckContext) -> str | None:
    """The group's versions against its lease's. With in-flight updates a node may hold, when it starts a lease,
    a version published after the lease was granted (the coordinator refused any span newer than its current
    version at submission): the oldest span may then be up to max_staleness versions after the lease's."""
    k = ctx.run.max_staleness
    reference = g.lease_version + (k if g.sampling.in_flight_updates else 0)
    problem = staleness_problem(g.policy_version, reference, k if reference == g.lease_version else 2 * k)
    if problem is None:
        problem = version_spans_problem(g.group, g.policy_version, k)
    return None if problem is None else f"against the lease's version: {problem}"


def check_shape(g: PendingGroup, ctx: CheckContext) -> str | None:
    """The reason the group's shape or termination is inconsistent with its lease, or None."""
    tok = ctx.tokenizer
    expected_prompt = render_prompt(tok, g.prompt_text)
    if g.group.prompt_ids != expected_prompt:
        return "prompt tokens do not match the leased prompt"
    if (problem := group_problem(g.group, g.seeds, g.sampling)) is not None:
        return problem
    vocab = ctx.vocab_size or len(tok)
    stops = ctx.stop_ids or frozenset({tok.eos_token_id})
    for i, r in enumerate(g.group.rollouts):
        ids = r.completion_ids
        if any(t >= vocab for t in ids):
            return f"rollout {i}: token id outside the vocabulary"
        if ctx.max_positions is not None and len(expected_prompt) + len(ids) > ctx.max_positions:
            return f"rollout {i}: longer than the model's length limit"
        if g.sampling.max_turns > 1:
            if ctx.env is None:
                raise RuntimeError("a multi-turn run's group, but the verifier has no environment")
            episode = ctx.episode(g, len(expected_prompt))
            if (problem := episode_problem(episode, ids, r.logprobs, r.turns, r.finish_reason, r.seed)) is not None:
                return f"rollout {i}: {problem}"
            continue
        if any(t in stops for t in ids[:-1]):
            return f"rollout {i}: tokens after a stop token"
        ends_eos = ids[-1] in stops
        if r.finish_reason == "stop" and not ends_eos:
            return f"rollout {i}: finish 'stop' without a stop token"
        at_limit = len(ids) == g.sampling.max_tokens or (
            ctx.max_positions is not None and len(expected_prompt) + len(ids) == ctx.max_positions)
        if r.finish_reason == "length" and (ends_eos or not at_limit):
            return f"rollout {i}: finish 'length' before max_tokens"
    return None


def check_proofs_decode(g: PendingGroup, ctx: CheckContext) -> str | None:
    """Every rollout's proof must be present (when required), well formed and fit its completion."""
    for i, r in enumerate(g.group.rollouts):
        if r.proof is None:
            if ctx.run.proofs.required:
                return f"rollout {i}: no activation proof (this pool requires them)"
            continue
        try:
            p = proofs.decode(r.proof)
        except proofs.ProofError as e:
            return f"rollout {i}: malformed activation proof ({e})"
        if p.n_tokens != (n := sum(b - a for a, b in model_spans(r.turns, len(r.completion_ids)))):
            return f"rollout {i}: proof covers {p.n_tokens} tokens, the completion's model turns have {n}"
        if (p.chunk_tokens, p.topk) != (ctx.run.proofs.chunk_tokens, ctx.run.proofs.topk):
            return f"rollout {i}: proof parameters {p.chunk_tokens}x{p.topk} are not the pool's"
        if ctx.hidden_size is not None and p.hidden_size != ctx.hidden_size:
            return f"rollout {i}: proof hidden size {p.hidden_size}, the model's is {ctx.hidden_size}"
    return None


def check_logprob_consistency(g: PendingGroup, ctx: CheckContext) -> str | None:
    """Rollouts that share their first i + 1 tokens must claim (nearly) the same logprob at position i."""
    if ctx.logprob_abs is None:
        return None
    rollouts = g.group.rollouts
    cls: dict[int, int] = dict.fromkeys(range(len(rollouts)), 0)  # rollout -> class of equal prefixes so far
    i = 0
    while len(cls) > 1:
        classes: dict[tuple[int, int], list[int]] = {}
        for k, c in cls.items():
            ids = rollouts[k].completion_ids
            if i < len(ids):
                classes.setdefault((c, ids[i]), []).append(k)
        cls = {}
        for n, members in enumerate(classes.values()):
            if len(members) < 2:
                continue
            lps = [rollouts[k].logprobs[i] for k in members]
            if max(lps) - min(lps) > 2 * ctx.logprob_abs:
                return (f"rollouts {members[0]} and {members[1]} share their first {i + 1} tokens but claim logprobs "
                        f"{max(lps):.6g} and {min(lps):.6g} for token {i}")
            cls.update(dict.fromkeys(members, n))
        i += 1
    return None


def _content(g: PendingGroup, r_index: int) -> bytes:
    """What a rollout's proof commits to: the prompt and the completion without its last token."""
    r = g.group.rollouts[r_index]
    return hashlib.blake2b(repr((g.group.prompt_ids, r.completion_ids[:-1])).encode(), digest_size=16).digest()


def check_proof_reuse(g: PendingGroup, ctx: CheckContext) -> str | None:
    """The same proof text for other committed content, in this group or (with a ledger) an earlier group of the
    same node: a copied proof. Records this group's proofs in the ledger."""
    seen: dict[str, tuple[int, bytes]] = {}
    for i, r in enumerate(g.group.rollouts):
        if r.proof is None:
            continue
        content = _content(g, i)
        if r.proof in seen and seen[r.proof][1] != content:
            return f"rollouts {seen[r.proof][0]} and {i} carry the same activation proof for different tokens"
        seen.setdefault(r.proof, (i, content))
        if ctx.proof_ledger is not None and ctx.proof_ledger.conflicts(g.node_id, r.proof, content):
            return f"rollout {i} carries an activation proof this node already sent for different tokens"
    if ctx.proof_ledger is not None:
        for proof, (_, content) in seen.items():
            ctx.proof_ledger.record(g.node_id, proof, content)
    return None


class ProofLedger:
    """Digests of the proofs each node sent recently and of what they committed to, the newest `capacity`."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._seen: OrderedDict[bytes, bytes] = OrderedDict()

    @staticmethod
    def _key(node_id: str, proof: str) -> bytes:
        return hashlib.blake2b(f"{node_id}/{proof}".encode(), digest_size=16).digest()

    def conflicts(self, node_id: str, proof: str, content: bytes) -> bool:
        earlier = self._seen.get(self._key(node_id, proof))
        return earlier is not None and earlier != content

    def record(self, node_id: str, proof: str, content: bytes) -> None:
        key = self._key(node_id, proof)
        self._seen[key] = content
        self._seen.move_to_end(key)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)


def reward_problem(trusted: list[float]) -> str | None:
    """A reward the task computed that is not a finite number: the task's fault, not proof of cheating."""
    if not all(math.isfinite(x) for x in trusted):
        return "the task gave a non-finite reward"
    return None


def scored_rollouts(g: PendingGroup, ctx: CheckContext) -> list[Scored]:
    """Trusted rewards, each with whether a time limit decided it: the completion decoded here, scored against the
    coordinator's answer (`Task.scored`)."""
    out = []
    for r in g.group.rollouts:  # an episode is scored on its last model turn, its answer
        text = ctx.tokenizer.decode(last_model_turn(r.completion_ids, r.turns), skip_special_tokens=True)
        out.append(ctx.task.scored(text, g.answer))
    return out


def rewards(g: PendingGroup, ctx: CheckContext) -> list[float]:
    """Trusted rewards: the completion decoded here, scored against the coordinator's answer."""
    return [s.reward for s in scored_rollouts(g, ctx)]


def check_claimed_rewards(g: PendingGroup, trusted: list[float], limited: list[bool] | None = None) -> str | None:
    """A node need not claim rewards; one that claims a wrong one is lying about a checkable fact. Not where a time
    limit decided the trusted reward (`limited`): the node's machine may have scored the rollout otherwise in good
    faith (a program that passes, slowly). The trusted reward is the one trained on either way."""
    for i, (r, t) in enumerate(zip(g.group.rollouts, trusted, strict=True)):
        if limited is not None and limited[i]:
            continue
        if r.claimed_reward is not None and not abs(r.claimed_reward - t) <= REWARD_CLAIM_TOL:
            return f"rollout {i}: claimed reward {r.claimed_reward} but the completion earns {t}"
    return None


def missing_proof(g: PendingGroup, ctx: CheckContext) -> str | None:
    """A rollout without a proof where the pool requires one: refused, but not proof of cheating (a node
    configured without proofs), so it earns no ban."""
    if ctx.run.proofs.required:
        for i, r in enumerate(g.group.rollouts):
            if r.proof is None:
                return f"rollout {i}: no activation proof (this pool requires them)"
    return None


def score(g: PendingGroup, ctx: CheckContext) -> tuple[list[float], str | None, bool]:
    """(trusted rewards, reason to reject or None, whether the reason proves cheating): a claimed reward that is not
    the trusted one does; a non-finite reward (`reward_problem`) does not. Rewarding can be costly (a sandbox
    runs code), so the verifier scores a group only once it is held or has passed its full check. What a task
    bounds by time (a sandbox's wall clock, a parse timeout) never bans: see `check_claimed_rewards`."""
    outcomes = scored_rollouts(g, ctx)
    trusted = [s.reward for s in outcomes]
    if (reason := check_claimed_rewards(g, trusted, [s.limited for s in outcomes])) is not None:
        return trusted, reason, True
    return trusted, reward_problem(trusted), False


def cheap_checks(g: PendingGroup, ctx: CheckContext, scored: bool = True) -> tuple[str | None, list[float]]:
    """(reason to reject or None, trusted rewards). Every failure here proves the group was not made honestly,
    except a missing proof (see `missing_proof`, which callers check first to refuse without a ban) and a
    non-finite reward (`reward_problem`, which callers check on the rewards returned). `scored=False`: the
    microsecond checks only, no rewards (the verifier `score`s later)."""
    for check in (check_versions, check_shape, check_proofs_decode, check_logprob_consistency, check_proof_reuse):
        reason = check(g, ctx)
        if reason is not None:
            return reason, []
    if not scored:
        return None, []
    outcomes = scored_rollouts(g, ctx)
    trusted = [s.reward for s in outcomes]
    return check_claimed_rewards(g, trusted, [s.limited for s in outcomes]), trusted
