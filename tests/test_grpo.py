"""GRPO maths on a real (tiny) model: advantages, filtering, the step's direction, clipping, the cap, KL."""

from __future__ import annotations

import copy

import pytest
import torch

from swarmrl.protocol.messages import TrainingGroup
from swarmrl.testing.groups import training_group
from swarmrl.trainer.grpo import (
    Batch,
    GRPOConfig,
    build_batch,
    filter_groups,
    group_advantages,
    grpo_loss,
    grpo_step,
    make_optimizer,
    token_logprobs,
)
from swarmrl.trainer.model import ModelConfig, build_model, build_tokenizer

torch.set_num_threads(1)

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=1, intermediate_size=64, seed=0)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def fresh_model(tok, seed: int = 0):
    return build_model(ModelConfig(**{**TINY.__dict__, "seed": seed}), tok).eval()


def completion_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]


def on_policy_group(model, tok, prompt: str, texts: list[str], rewards: list[float], group_id: int = 1,
                    version: int = 0) -> TrainingGroup:
    """A group whose sampler logprobs are the model's own (ratio 1): what an honest, fresh node sends."""
    prompt_ids = tok(prompt).input_ids
    comps = [completion_ids(tok, t) for t in texts]
    g = training_group(group_id=group_id, policy_version=version, prompt_ids=prompt_ids, completions=comps,
                       logprobs=[[0.0] * len(c) for c in comps], finish_reasons=["stop"] * len(comps),
                       rewards=rewards)
    batch = build_batch([g], tok.pad_token_id)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    for i, r in enumerate(g.group.rollouts):
        r.logprobs = lp[i][batch.loss_mask[i] > 0].tolist()
    return g


def seq_logprob(model, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    return (lp * batch.loss_mask).sum(-1)


def make_group(rewards: list[float], gid: int = 1, comp_len: int = 3) -> TrainingGroup:
    n = len(rewards)
    return training_group(group_id=gid, policy_version=0, prompt_ids=[1, 4, 5], completions=[[6] * comp_len] * n,
                         logprobs=[[-1.0] * comp_len] * n, finish_reasons=["stop"] * n, rewards=rewards)


# -- advantages and filtering -----------------------------------------------------------------------


def test_advantages_normalise_within_each_group():
    a = group_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0]))
    assert torch.allclose(a, torch.tensor([-1.0, 1.0, 1.0, -1.0]), atol=1e-3)
    b = group_advantages(torch.tensor([10.0, 12.0, 14.0]))
    assert abs(b.mean().item()) < 1e-6 and abs(b.std(correction=0).item() - 1) < 1e-3
    assert torch.all(group_advantages(torch.tensor([0.5, 0.5, 0.5])) == 0)

    # In a batch each group is normalised by its own statistics, not the batch's.
    batch = build_batch([make_group([0.0, 1.0]), make_group([100.0, 100.5], gid=2)], pad_id=0)
    assert torch.allclose(batch.advantages, torch.tensor([-1.0, 1.0, -1.0, 1.0]), atol=1e-3)


def test_zero_advantage_groups_are_filtered_and_a_group_without_one_reward_per_rollout_cannot_exist():
    good, flat = make_group([0.0, 1.0, 0.5], gid=1), make_group([1.0, 1.0, 1.0], gid=2)
    keep, drop = filter_groups([good, flat])
    assert [g.group_id for g in keep] == [1] and [g.group_id for g in drop] == [2]
    keep, _ = filter_groups([good, flat], filter_zero_advantage=False)
    assert [g.group_id for g in keep] == [1, 2]
    with pytest.raises(ValueError, match="2 rewards for 3 rollouts"):
        TrainingGroup.model_validate({**good.model_dump(), "rewards": [0.0, 1.0]})


def test_batch_masks_only_completion_tokens(tok):
    g = training_group(group_id=1, policy_version=0, prompt_ids=[1, 4, 5, 14], completions=[[6, 2], [7, 8, 9, 2]],
                      logprobs=[[-0.1, -0.2], [-0.3, -0.4, -0.5, -0.6]], finish_reasons=["stop", "stop"],
                      rewards=[0.0, 1.0])
    b = build_batch([g], pad_id=tok.pad_token_id)
    assert b.input_ids.tolist() == [[1, 4, 5, 14, 6, 2, 0, 0], [1, 4, 5, 14, 7, 8, 9, 2]]
    assert b.attention_mask.sum(-1).tolist() == [6, 8]
    # Position t predicts token t+1: the completion starts at token 4, so at position 3.
    assert b.loss_mask.tolist() == [[0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1]]
    assert torch.allclose(b.sampler_logprobs[1, 3:], torch.tensor([-0.3, -0.4, -0.5, -0.6]))
    assert b.num_tokens == 6


# -- the step ---------------------------------------------------------------------------------------


def test_step_raises_good_completions_and_lowers_bad_ones(tok):
    model = fresh_model(tok)
    good, bad = "46", "99"
    groups = [on_policy_group(model, tok, "12+34=", [good, bad, good, bad], [1.0, 0.0, 1.0, 0.0], group_id=1),
              on_policy_group(model, tok, "50+21=", ["71", "12", "71", "3"], [1.0, 0.0, 1.0, 0.0], group_id=2)]
    batch = build_batch(groups, tok.pad_token_id)
    cfg = GRPOConfig()
    before = seq_logprob(model, batch)
    with torch.no_grad():
        loss_before, _ = grpo_loss(token_logprobs(model, batch.input_ids, batch.attention_mask)[0], batch, cfg)
    opt = make_optimizer(model, lr=1e-3)
    stats = grpo_step(model, opt, batch, cfg)
    after = seq_logprob(model, batch)
    with torch.no_grad():
        loss_after, _ = grpo_loss(token_logprobs(model, batch.input_ids, batch.attention_mask)[0], batch, cfg)

    up = batch.advantages > 0
    assert torch.all(after[up] > before[up]), (before, after)
    assert torch.all(after[~up] < before[~up]), (before, after)
    assert loss_after < loss_before
    # On-policy: ratio exactly 1, nothing clipped; the loss of the step is -mean(A) over tokens.
    assert stats["clip_fraction"] == 0.0 and stats["mean_abs_ratio_minus_1"] < 1e-6
    assert stats["entropy"] > 0 and stats["grad_norm"] > 0
    assert stats["tokens"] == batch.num_tokens


def test_micro_batches_give_the_same_step(tok):
    model = fresh_model(tok)
    groups = [on_policy_group(model, tok, "12+34=", ["46", "9", "460", "4"], [1.0, 0.0, 0.5, 0.2], group_id=1),
              on_policy_group(model, tok, "50+21=", ["71", "12"], [1.0, 0.0], group_id=2)]
    batch = build_batch(groups, tok.pad_token_id)
    batch.sampler_logprobs = batch.sampler_logprobs + 0.1 * torch.randn_like(batch.sampler_logprobs) * batch.loss_mask
    whole, split = copy.deepcopy(model), copy.deepcopy(model)
    s1 = grpo_step(whole, make_optimizer(whole), batch, GRPOConfig())
    s2 = grpo_step(split, make_optimizer(split), batch, GRPOConfig(), micro_batch_size=2)
    assert abs(s1["loss"] - s2["loss"]) < 1e-6
    assert abs(s1["clip_fraction"] - s2["clip_fraction"]) < 1e-9
    for p, q in zip(whole.parameters(), split.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)


# -- clipping ---------------------------------------------------------------------------------------


def leaf_logprobs(batch: Batch, offset: torch.Tensor) -> torch.Tensor:
    """'New' logprobs = sampler logprobs + offset, as a leaf we can take gradients at."""
    return (batch.sampler_logprobs + offset).detach().requires_grad_(True)


def test_clipped_tokens_get_no_gradient_and_are_counted():
    # Group 1 (A > 0 for the first rollout): its tokens are far more likely now than when sampled.
    g = make_group([1.0, 0.0, 1.0, 0.0], comp_len=3)
    batch = build_batch([g], pad_id=0)
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.28)
    offset = torch.zeros_like(batch.sampler_logprobs)
    offset[0] = 2.0   # A > 0, ratio e^2 = 7.4 > 1.28: clipped
    offset[1] = -2.0  # A < 0, ratio e^-2 = 0.14 < 0.8: clipped
    offset[2] = 0.1   # A > 0, ratio 1.105, inside: gradient
    offset[3] = 0.5   # A < 0, ratio 1.65 (> 1 + clip_high, but for A < 0 only the low side clips): gradient
    new = leaf_logprobs(batch, offset * batch.loss_mask)
    loss, sums = grpo_loss(new, batch, cfg)
    loss.backward()
    m = batch.loss_mask > 0
    grad = new.grad
    assert torch.all(grad[0][m[0]] == 0) and torch.all(grad[1][m[1]] == 0)
    assert torch.all(grad[2][m[2]] != 0) and torch.all(grad[3][m[3]] != 0)
    assert torch.all(grad[~m] == 0)  # padding and prompt never get gradient
    from swarmrl.trainer.grpo import finish_stats

    stats = finish_stats(sums)
    assert stats["clip_fraction"] == pytest.approx(6 / 12)
    assert stats["cap_fraction"] == 0.0
    expected_dev = (abs(torch.exp(torch.tensor(2.0)) - 1) + abs(torch.exp(torch.tensor(-2.0)) - 1)
                    + abs(torch.exp(torch.tensor(0.1)) - 1) + abs(torch.exp(torch.tensor(0.5)) - 1)) / 4
    assert stats["mean_abs_ratio_minus_1"] == pytest.approx(expected_dev.item(), rel=1e-5)


def test_a_far_off_sampler_logprob_is_clipped_in_a_real_step(tok):
    model = fresh_model(tok)
    g = on_policy_group(model, tok, "12+34=", ["46", "99"], [1.0, 0.0])
    r0, r1 = g.group.rollouts[0], g.group.rollouts[1]
    r0.logprobs = [lp - 3.0 for lp in r0.logprobs]  # sampler thought "46" far less likely: ratio e^3
    r1.logprobs = [lp + 3.0 for lp in r1.logprobs]  # and "99" far more likely: ratio e^-3
    batch = build_batch([g], tok.pad_token_id)
    before = [p.detach().clone() for p in model.parameters()]
    stats = grpo_step(model, make_optimizer(model), batch, GRPOConfig())
    assert stats["clip_fraction"] == 1.0 and stats["grad_norm"] == 0.0
    # Every token clipped: no gradient, so AdamW (no weight decay) leaves the weights alone.
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))


def test_negative_advantage_ratio_is_capped():
    g = make_group([0.0, 1.0], comp_len=2)  # rollout 0 has A = -1
    batch = build_batch([g], pad_id=0)
    m = batch.loss_mask > 0
    offset = torch.zeros_like(batch.sampler_logprobs)
    offset[0] = 3.0  # ratio e^3 ~ 20 for a negative-advantage rollout
    capped_cfg, uncapped_cfg = GRPOConfig(clip_ratio_max=4.0), GRPOConfig(clip_ratio_max=1e9)

    new = leaf_logprobs(batch, offset * batch.loss_mask)
    loss, sums = grpo_loss(new, batch, capped_cfg)
    loss.backward()
    assert torch.all(new.grad[0][m[0]] == 0)  # capped: no push down
    from swarmrl.trainer.grpo import finish_stats

    stats = finish_stats(sums)
    assert stats["cap_fraction"] == pytest.approx(0.5) and stats["clip_fraction"] == pytest.approx(0.5)
    # The capped tokens contribute -(4 * A) ~ 4 each, rollout 1 (ratio 1, A = +1) contributes -1 each.
    assert loss.item() == pytest.approx((2 * 4.0 + 2 * -1.0) / 4, rel=1e-3)  # |A| = 0.5 / (0.5 + 1e-4)

    new = leaf_logprobs(batch, offset * batch.loss_mask)
    loss, _ = grpo_loss(new, batch, uncapped_cfg)
    loss.backward()
    assert torch.all(new.grad[0][m[0]] != 0)  # plain PPO clipping lets the ratio push without bound
    assert loss.item() > 9  # (2 * e^3 - 2) / 4 against 1.5 with the cap

    # Below the cap a negative-advantage token keeps its gradient.
    new = leaf_logprobs(batch, (offset / 3.0) * batch.loss_mask)  # ratio e ~ 2.7 < 4
    loss, _ = grpo_loss(new, batch, capped_cfg)
    loss.backward()
    assert torch.all(new.grad[0][m[0]] != 0)


# -- KL ---------------------------------------------------------------------------------------------


def test_kl_is_zero_when_policy_is_the_reference(tok):
    model = fresh_model(tok)
    ref = copy.deepcopy(model)
    g = on_policy_group(model, tok, "12+34=", ["46", "99", "4"], [1.0, 0.0, 0.3])
    batch = build_batch([g], tok.pad_token_id)
    with_kl, without = copy.deepcopy(model), copy.deepcopy(model)
    s_kl = grpo_step(with_kl, make_optimizer(with_kl), batch, GRPOConfig(kl_coef=0.5), ref_model=ref)
    s_no = grpo_step(without, make_optimizer(without), batch, GRPOConfig(kl_coef=0.0))
    assert s_kl["kl"] == pytest.approx(0.0, abs=1e-9)
    assert s_kl["loss"] == pytest.approx(s_no["loss"], abs=1e-7)
    for p, q in zip(with_kl.parameters(), without.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-7)

    # A different reference gives a positive KL that adds to the loss.
    other = fresh_model(tok, seed=1)
    probe = copy.deepcopy(model)
    s_other = grpo_step(probe, make_optimizer(probe), batch, GRPOConfig(kl_coef=0.5), ref_model=other)
    assert s_other["kl"] > 1e-3
    assert s_other["loss"] == pytest.approx(s_no["loss"] + 0.5 * s_other["kl"], rel=1e-4)
