"""Cheap checks (termination, shape, versions, claims, proof presence, consistency of claimed logprobs, copied
proofs) and the check policy, without a server."""

from __future__ import annotations

import pytest
import torch

from swarmrl.node.proof import build_proof
from swarmrl.protocol import messages as m
from swarmrl.protocol.quarantine import Check, Rules
from swarmrl.protocol.run import RunSpec
from swarmrl.protocol.tasks import TaskSpec, load_task
from swarmrl.trainer.model import build_tokenizer
from swarmrl.verifier.checks import CheckContext, ProofLedger, cheap_checks, reward_problem
from swarmrl.verifier.policy import CheckPolicy

TOK = build_tokenizer()
EOS = TOK.eos_token_id
DIGITS = [TOK.convert_tokens_to_ids(c) for c in "579"]


def rollout(ids: list[int], finish: str, seed: int, **kw) -> m.Rollout:
    proof = build_proof(torch.randn(len(ids), 16)) if ids else None
    return m.Rollout(seed=seed, completion_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=finish,
                     proof=kw.pop("proof", proof), **kw)


def group(rollouts: list[m.Rollout], *, prompt: str = "123+456=", max_tokens: int = 4, policy_version: int = 3,
          lease_version: int = 3) -> m.PendingGroup:
    return m.PendingGroup(group_id=1, node_id="n", prompt_text="123+456=", answer="579", lease_version=lease_version,
                          sampling=m.SamplingSpec(max_tokens=max_tokens, group_size=2), seeds=[1, 2],
                          policy_version=policy_version,
                          group=m.RolloutGroup(prompt_id="p", prompt_ids=TOK(prompt).input_ids, rollouts=rollouts))


CTX = CheckContext(tokenizer=TOK, task=load_task(TaskSpec()), run=RunSpec(max_staleness=1), max_positions=13,
                   hidden_size=16)
GOOD = [rollout(DIGITS + [EOS], "stop", 1), rollout([DIGITS[0]] * 4, "length", 2)]


def test_honest_group_passes_with_trusted_rewards():
    reason, rewards = cheap_checks(group(GOOD), CTX)
    assert reason is None and rewards == [1.0, pytest.approx(0.5 / 4)]


def test_any_stop_token_of_the_model_ends_a_completion():
    """A model with two stop tokens (e.g. <|im_end|> and <|endoftext|>): either ends a 'stop' completion, neither
    may come before the end, and a token that is not a stop does not make a 'stop'."""
    other = DIGITS[1]  # stands for the second stop token here
    ctx = CheckContext(**{**CTX.__dict__, "stop_ids": frozenset({EOS, other})})
    ends_other = [rollout([DIGITS[0], other], "stop", 1), GOOD[1]]
    assert cheap_checks(group(ends_other), ctx)[0] is None
    assert "without a stop token" in cheap_checks(group(ends_other), CTX)[0]  # eos alone: the digit is no stop
    inner = [rollout([DIGITS[0], other, DIGITS[0], DIGITS[2]], "length", 1), GOOD[1]]
    assert "tokens after a stop token" in cheap_checks(group(inner), ctx)[0]
    assert cheap_checks(group(inner), CTX)[0] is None


@pytest.mark.parametrize("rollouts,kw,expected", [
    ([rollout(DIGITS, "stop", 1), GOOD[1]], {}, "'stop' without a stop token"),
    ([rollout(DIGITS, "length", 1), GOOD[1]], {}, "'length' before max_tokens"),
    ([rollout(DIGITS[:1] + [EOS] + DIGITS[:2], "length", 1), GOOD[1]], {}, "tokens after a stop token"),
    ([rollout(DIGITS + [EOS], "stop", 1), rollout(DIGITS[:3] + [EOS], "length", 2)], {}, "'length' before"),
    ([rollout(DIGITS * 2, "length", 1), GOOD[1]], {}, "exceed max_tokens"),
    ([rollout([], "length", 1), GOOD[1]], {}, "empty completion"),
    ([rollout([99], "length", 1), GOOD[1]], {}, "outside the vocabulary"),
    ([GOOD[0], rollout([DIGITS[0]] * 4, "length", 7)], {}, "seeds do not match"),
    (GOOD, {"prompt": "999+456="}, "prompt tokens"),
    (GOOD, {"policy_version": 4}, "newer than 3"),
    (GOOD, {"policy_version": 1}, "versions behind"),
    ([GOOD[0], rollout([DIGITS[0]] * 4, "length", 2, proof=None)], {}, "no activation proof"),
    ([GOOD[0], rollout([DIGITS[0]] * 4, "length", 2, proof="AAAA")], {}, "malformed activation proof"),
    ([GOOD[0], rollout([DIGITS[0]] * 4, "length", 2, proof=build_proof(torch.randn(3, 16)))], {}, "covers 3"),
    ([GOOD[0], rollout([DIGITS[0]] * 4, "length", 2, proof=build_proof(torch.randn(4, 32)))], {}, "hidden size"),
    ([GOOD[0], rollout([DIGITS[0]] * 4, "length", 2, claimed_reward=1.0)], {}, "claimed reward"),
])
def test_inconsistent_groups_are_rejected(rollouts, kw, expected):
    reason, _ = cheap_checks(group(rollouts, **kw), CTX)
    assert reason is not None and expected in reason


def test_length_at_the_model_limit_is_a_valid_ending():
    # prompt of 9 tokens (BOS + 8 chars) + 4 tokens = max_positions 13: 'length' although max_tokens is 5.
    ok = group([GOOD[0], rollout([DIGITS[0]] * 4, "length", 2)], max_tokens=5)
    assert cheap_checks(ok, CTX)[0] is None
    assert "before max_tokens" in cheap_checks(ok, CheckContext(**{**CTX.__dict__, "max_positions": 64}))[0]
    too_long = group([GOOD[0], rollout([DIGITS[0]] * 5, "length", 2)], max_tokens=5)
    assert "length limit" in cheap_checks(too_long, CTX)[0]
    # An honest claim is fine.
    claimed = [GOOD[0], rollout([DIGITS[0]] * 4, "length", 2, claimed_reward=0.125)]
    assert cheap_checks(group(claimed), CTX)[0] is None


def test_policy_checks_new_nodes_then_samples():
    policy = CheckPolicy(Rules(warmup_checks=3, sample_rate=0.25, max_held=5), seed=0)
    assert all(policy.decide(passes=2, held=0) is Check.WARMUP for _ in range(50))
    draws = [policy.decide(passes=3, held=0) for _ in range(2000)]
    assert 0.2 < draws.count(Check.SAMPLED) / len(draws) < 0.3
    assert set(draws) == {Check.SAMPLED, Check.HOLD}
    at_cap = [policy.decide(passes=3, held=5) for _ in range(200)]
    assert set(at_cap) == {Check.SAMPLED, Check.OVERFLOW}  # never held beyond the cap
    assert CheckPolicy(Rules(warmup_checks=3, sample_rate=0.0)).decide(passes=3, held=0) is Check.HOLD


def test_shared_prefixes_must_claim_the_same_logprobs():
    ctx = CheckContext(**{**CTX.__dict__, "logprob_abs": 5e-4})
    a = rollout(DIGITS + [EOS], "stop", 1)
    b = rollout([DIGITS[0]] * 4, "length", 2)  # shares the first token with a
    ok = [a, b.model_copy(update={"logprobs": [-0.5 + 9e-4, -0.1, -0.1, -0.1]})]  # within 2 x tolerance
    assert cheap_checks(group(ok), ctx)[0] is None
    bad = [a, b.model_copy(update={"logprobs": [-0.52, -0.5, -0.5, -0.5]})]
    reason = cheap_checks(group(bad), ctx)[0]
    assert reason is not None and "share their first 1 tokens" in reason
    # Different first tokens: nothing to compare.
    c = rollout([DIGITS[1]] * 4, "length", 2).model_copy(update={"logprobs": [-3.0] * 4})
    assert cheap_checks(group([a, c]), ctx)[0] is None


def test_a_copied_proof_is_caught_within_a_group_and_across_a_nodes_groups():
    same = build_proof(torch.randn(4, 16))
    a = rollout(DIGITS + [EOS], "stop", 1, proof=same)
    b = rollout([DIGITS[0]] * 4, "length", 2, proof=same)
    reason = cheap_checks(group([a, b]), CTX)[0]
    assert reason is not None and "same activation proof" in reason
    # The same states commit to the same proof: completions differing only in their last token may share one.
    b_same_states = rollout(DIGITS + [DIGITS[0]], "length", 2, proof=same)
    assert cheap_checks(group([a, b_same_states]), CTX)[0] is None
    ledger = ProofLedger()
    ctx = CheckContext(**{**CTX.__dict__, "proof_ledger": ledger})
    first = group(GOOD)
    assert cheap_checks(first, ctx)[0] is None
    copied = [GOOD[0], rollout([DIGITS[1]] * 4, "length", 2, proof=GOOD[1].proof)]
    reason = cheap_checks(group(copied), ctx)[0]
    assert reason is not None and "already sent" in reason
    # Only the node's own proofs count: another node cannot be framed by a proof sent first.
    other = group(copied).model_copy(update={"node_id": "m"})
    assert cheap_checks(other, ctx)[0] is None
    assert cheap_checks(first, ctx)[0] is None  # the same group again (a deferred group claimed again)


def test_a_non_finite_reward_is_refused_without_blame():
    assert reward_problem([0.0, 1.0]) is None
    assert "non-finite" in reward_problem([0.0, float("nan")])
