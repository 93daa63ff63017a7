"""The full check gives up early on garbage and keeps its memory bounded, without changing any verdict:

- honest groups (torch engine, 128-token completions) pass, with the same measurements as a check that never
  stops early;
- garbage (random tokens, made-up logprobs, another rollout's well-formed proof) fails in the probe, having put
  under 5% of an honest group's tokens through the model; garbage after an honest prefix fails at the first
  span that reaches it; a node's other groups are not checked once one failed;
- logits are scored a bounded number of positions at a time; the chunked prefill equals one forward.

Costs are counted in tokens put through the model (deterministic); bench/byzantine.py measures seconds.
"""

from __future__ import annotations

import random

import pytest
import torch

from swarmrl.testing.byzantine import garbage as gb
from swarmrl.trainer.model import ModelConfig, build_tokenizer
from swarmrl.verifier import full_check as fc
from swarmrl.verifier.config import Tolerances
from swarmrl.verifier.full_check import Staging, full_check
from swarmrl.verifier.models import load_policy
from swarmrl.verifier.prefill import ChunkedPrefill

TOL = Tolerances()
TOK = build_tokenizer()
ORDINARY = [i for i in range(len(TOK)) if i not in TOK.all_special_ids]
MAX_TOKENS = 128


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ckpt = gb.rare_eos_checkpoint(tmp_path_factory.mktemp("m") / "ckpt", ModelConfig(max_positions=256))
    groups = gb.generate_groups(ckpt, gb.prompts(4, seed=1), max_tokens=MAX_TOKENS, seed=2)
    assert all(len(r.completion_ids) == MAX_TOKENS for g in groups for r in g.group.rollouts)
    return load_policy(ckpt, 0), groups


def test_honest_groups_pass_and_measure_as_a_full_check(setup):
    policy, groups = setup
    staged = full_check(groups, policy, TOL, rng=random.Random(0))
    whole = full_check(groups, policy, TOL, staging=Staging(early_exit=False))
    for s, w in zip(staged, whole, strict=True):
        assert s.reason is None and w.reason is None and s.stage == "complete"
        assert s.tokens == w.tokens == 8 * MAX_TOKENS
        assert s.proof_checked == w.proof_checked > 0
        assert abs(s.max_logprob_diff - w.max_logprob_diff) < 1e-5 and s.max_logprob_diff < 1e-4
        assert s.proof_max_ulp <= 0.51 and s.replay_mismatches == 0
        # Every real token once, plus the probe: prompt + 16 tokens of one rollout.
        full = sum(len(g.group.prompt_ids) + MAX_TOKENS - 1 for _ in range(8) for g in groups[:1])
        assert s.prefill_tokens == full + len(groups[0].group.prompt_ids) + 15


def test_garbage_fails_in_the_probe_for_a_small_fraction_of_an_honest_check(setup):
    policy, groups = setup
    rng = random.Random(3)
    proof = groups[0].group.rollouts[0].proof  # well formed, for 128 tokens, of other states
    bad = [gb.garbage(g, rng, ORDINARY, proof=proof) for g in groups]
    honest = full_check(groups, policy, TOL)
    reports = full_check(bad, policy, TOL)
    for rep, ok in zip(reports, honest, strict=True):
        assert rep.stage == "probe" and rep.reason is not None and not rep.skipped
        assert rep.prefill_tokens <= 0.05 * ok.prefill_tokens
        assert {f.split(":")[0] for f in rep.failures} >= {"replay", "logprobs"}


def test_garbage_after_an_honest_prefix_fails_where_it_starts(setup):
    policy, groups = setup
    bad = gb.garbage(groups[0], random.Random(4), ORDINARY, keep=40).model_copy(update={"node_id": "cheat"})
    honest, rep = full_check([groups[0], bad], policy, TOL, rng=random.Random(5))
    assert rep.reason is not None and rep.stage == "chunk 1"  # spans cover 16, 48, 112, 128 tokens
    assert "token 4" in rep.reason  # tokens 40..47 are the first garbage
    assert rep.prefill_tokens < 0.5 * honest.prefill_tokens


def test_a_nodes_other_groups_are_not_checked_after_it_failed(setup):
    policy, groups = setup
    rng = random.Random(6)
    bad = gb.garbage(groups[0], rng, ORDINARY)
    other = groups[1].model_copy(update={"node_id": "other"})
    same = groups[2].model_copy(update={"node_id": bad.node_id})
    rep_bad, rep_other, rep_same = full_check([bad, other, same], policy, TOL)
    assert rep_bad.stage == "probe" and rep_other.reason is None
    assert rep_same.skipped and rep_same.prefill_tokens <= 0.05 * rep_other.prefill_tokens
    assert "another group of this node failed" in rep_same.reason
    # A check that does not stop early checks everything (and fails only the garbage).
    reps = full_check([bad, other, same], policy, TOL, staging=Staging(early_exit=False))
    assert [r.reason is None for r in reps] == [False, True, True]


def test_logits_are_scored_a_bounded_number_of_positions_at_a_time(setup, monkeypatch):
    policy, groups = setup
    seen = []
    real = fc.replay_tokens

    def spy(logits, *a):
        seen.append(logits.shape[0])
        return real(logits, *a)

    monkeypatch.setattr(fc, "replay_tokens", spy)
    vocab = policy.model.get_output_embeddings().weight.shape[0]
    reports = full_check(groups, policy, TOL, staging=Staging(logit_memory_mb=1))
    assert all(r.reason is None for r in reports)
    rows = (1 << 20) // (vocab * 8 * fc._TEMPORARIES)
    assert max(seen) == rows  # a span had more positions than that: it was split
    assert sum(seen) == len(groups) * (8 * MAX_TOKENS + 16)  # every position once, and the probes
    # A 152k vocabulary at the default 256 MiB: ~29 positions at a time, never [512, vocab] for a rollout.
    assert (256 << 20) // (152_000 * 8 * fc._TEMPORARIES) < 512


def test_chunked_prefill_equals_one_forward(setup):
    policy, groups = setup
    seqs = [g.group.prompt_ids + r.completion_ids[:-1] for g in groups[:2] for r in g.group.rollouts[:3]]
    seqs[1] = seqs[1][:50]  # one shorter row: right padding
    with torch.inference_mode():
        ids = torch.full((len(seqs), max(map(len, seqs))), policy.pad_id)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
        whole = policy.model.model(input_ids=ids, use_cache=False).last_hidden_state
        pf = ChunkedPrefill(policy.model, seqs, policy.pad_id)
        first = pf.advance(20)
        pf.keep([0, 2, 5])
        rest = pf.advance(pf.width)
    assert torch.allclose(first, whole[:, :20], atol=1e-5)
    assert torch.allclose(rest, whole[[0, 2, 5], 20:], atol=1e-5)
    assert pf.real_tokens(20, pf.width)[0] == len(seqs[0]) - 20


def test_a_long_completion_of_a_large_vocabulary_is_scored_in_pieces(tmp_path, monkeypatch):
    """512 tokens of a 152k vocabulary: [512, vocab] float64 would be 623 MB per rollout; at the default budget
    the scoring never holds more than ~29 positions of it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from swarmrl.protocol import messages as m
    from swarmrl.testing.groups import pending_group
    from swarmrl.verifier.models import PolicyModel

    vocab, n = 152_000, 512
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).eval()
    policy = PolicyModel(version=0, path=tmp_path, model=model, tokenizer=TOK, eos_id=2, pad_id=0, hidden_size=32,
                         max_positions=1024)
    rng = random.Random(7)
    rollout = m.Rollout(seed=1, completion_ids=[rng.randrange(4, vocab) for _ in range(n)], logprobs=[-1.0] * n,
                        finish_reason="length")
    g = pending_group(group_id=1, node_id="n", prompt_text="1+1=", answer="2", policy_version=0,
                      sampling=m.SamplingSpec(max_tokens=n, group_size=2), seeds=[1, 2],
                      group=m.RolloutGroup(prompt_id="p", prompt_ids=[1, 5, 14, 5, 15], rollouts=[rollout]))
    seen = []
    real = fc.replay_tokens
    monkeypatch.setattr(fc, "replay_tokens", lambda logits, *a: seen.append(logits.shape) or real(logits, *a))
    (rep,) = full_check([g], policy, TOL, staging=Staging(early_exit=False))
    assert rep.reason is not None and rep.tokens == n  # everything scored (no early exit here)
    rows = (256 << 20) // (vocab * 8 * fc._TEMPORARIES)
    assert max(s[0] for s in seen) == rows and sum(s[0] for s in seen) == n
    assert all(s[1] == vocab for s in seen)
