"""Mismatch corrections in the GRPO loss (the run's `corrections`): truncated importance sampling caps each token's
weight, masked importance sampling drops the tokens whose engine/trainer ratio leaves the band, both are reported
per step, both are off by default with the loss unchanged, and the run description refuses bad settings."""

from __future__ import annotations

import pytest
import torch

from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.protocol.messages import RunInfo, TrainingBatch, TrainingGroup
from swarmrl.protocol.run import CorrectionSpec, RunSpec
from swarmrl.runtime.config import ConfigError, load_config
from swarmrl.testing.groups import training_group
from swarmrl.trainer.grpo import (
    Batch,
    GRPOConfig,
    build_batch,
    finish_stats,
    grpo_loss,
    grpo_step,
    make_optimizer,
    token_logprobs,
)
from swarmrl.trainer.loop import run_trainer
from swarmrl.trainer.model import ModelConfig, build_model, build_tokenizer, load_checkpoint
from swarmrl.trainer.state import read_step_log
from tests.support.trainer import COORDINATOR, FakeCoordinator, trainer_cfg

torch.set_num_threads(1)

TIS = CorrectionSpec(tis_cap=2.0)
MIS = CorrectionSpec(mask_band=(0.5, 2.0))

# Per-token log(pi_trainer / pi_engine) of a 4-rollout group, 3 completion tokens each. Rewards [1, 0, 1, 0] give
# advantages of +-1 (to 1e-4). Ratios: e^1.5 = 4.48 (above the cap and the band), e^-1 = 0.37 (below the band),
# e^0.5 = 1.65 and e^-0.2 = 0.82 (inside both), e^1 = 2.72 (above both).
LOG_RHO = torch.tensor([[1.5, 0.0, -1.0],
                        [0.5, 1.5, 0.0],
                        [-0.2, 1.0, 0.0],
                        [-1.0, 0.5, 1.5]])


def constructed() -> tuple[Batch, torch.Tensor]:
    """(batch, log-rho per position): engine logprobs of -1, the trainer's -1 + LOG_RHO on completion tokens."""
    g = training_group(group_id=1, policy_version=0, prompt_ids=[1, 4, 5], completions=[[6, 7, 8]] * 4,
                       logprobs=[[-1.0] * 3] * 4, rewards=[1.0, 0.0, 1.0, 0.0])
    batch = build_batch([g], pad_id=0)
    log_rho = torch.zeros_like(batch.sampler_logprobs)
    log_rho[batch.loss_mask > 0] = LOG_RHO.flatten()
    return batch, log_rho


def trainer_logprobs(batch: Batch, log_rho: torch.Tensor) -> torch.Tensor:
    """The trainer's logprobs as a leaf we can take gradients at."""
    return (batch.sampler_logprobs + log_rho).detach().requires_grad_(True)


def todays_loss(new_logprobs: torch.Tensor, batch: Batch, cfg: GRPOConfig, ref_logprobs: torch.Tensor
                ) -> torch.Tensor:
    """The loss as it was before the corrections existed, line for line."""
    mask = batch.loss_mask
    adv = batch.advantages[:, None].to(new_logprobs.dtype)
    ratio = torch.exp(((new_logprobs - batch.sampler_logprobs) * mask).clamp(-20.0, 20.0))
    objective = torch.minimum(ratio * adv, ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv)
    objective = torch.where(adv < 0, torch.maximum(objective, cfg.clip_ratio_max * adv), objective)
    d = (ref_logprobs - new_logprobs).clamp(-20.0, 20.0)
    per_token = -objective + cfg.kl_coef * (torch.exp(d) - d - 1.0)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def test_defaults_leave_the_loss_and_its_gradient_bit_identical():
    batch, log_rho = constructed()
    cfg = GRPOConfig(kl_coef=0.05)
    ref = batch.sampler_logprobs + 0.3 * batch.loss_mask
    old = trainer_logprobs(batch, log_rho)
    todays_loss(old, batch, cfg, ref).backward()
    assert RunSpec().corrections == CorrectionSpec(tis_cap=None, mask_band=None)
    for kwargs in ({}, {"correction": RunSpec().corrections}):
        new = trainer_logprobs(batch, log_rho)
        loss, sums = grpo_loss(new, batch, cfg, ref_logprobs=ref, **kwargs)
        loss.backward()
        assert torch.equal(loss, todays_loss(old.detach(), batch, cfg, ref)) and torch.equal(new.grad, old.grad)
        stats = finish_stats(sums)
        assert stats["truncated_fraction"] == 0.0 and stats["masked_fraction"] == 0.0
        assert stats["clip_fraction"] > 0  # the constructed ratios do reach the clip band


def test_truncation_caps_each_tokens_weight_at_the_cap():
    batch, log_rho = constructed()
    new = trainer_logprobs(batch, log_rho)
    loss, sums = grpo_loss(new, batch, GRPOConfig(), correction=TIS)
    loss.backward()
    m = batch.loss_mask > 0
    adv = batch.advantages[:, None].expand_as(new)[m]
    weight = torch.exp(log_rho[m]).clamp(max=2.0)
    # d loss / d logp = -min(rho, cap) * A / tokens: far-off tokens are weighted, not silenced by the clip band ...
    assert torch.allclose(new.grad[m], -weight * adv / 12, rtol=1e-5)
    # ... and one with rho = 4.48 counts exactly as much as one with rho = 2.72: both stop at the cap.
    assert new.grad[0][m[0]][0] == new.grad[2][m[2]][1]
    assert torch.all(new.grad[~m] == 0)
    stats = finish_stats(sums)
    assert stats["truncated_fraction"] == pytest.approx(4 / 12)  # the three e^1.5 and the e^1
    assert stats["masked_fraction"] == 0.0 and stats["clip_fraction"] == 0.0
    assert loss.item() == pytest.approx(-(weight * adv).sum().item() / 12, rel=1e-5)


def test_masked_tokens_contribute_no_gradient_and_are_counted():
    batch, log_rho = constructed()
    rho = torch.exp(log_rho)
    outside = (batch.loss_mask > 0) & ((rho < 0.5) | (rho > 2.0))
    assert int(outside.sum()) == 6  # e^1.5 three times, e^-1 twice, e^1 once

    for cfg_correction in (MIS, CorrectionSpec(tis_cap=2.0, mask_band=(0.5, 2.0))):
        new = trainer_logprobs(batch, log_rho)
        loss, sums = grpo_loss(new, batch, GRPOConfig(), correction=cfg_correction)
        loss.backward()
        assert torch.all(new.grad[outside] == 0)
        assert torch.all(new.grad[(batch.loss_mask > 0) & ~outside] != 0)
        stats = finish_stats(sums)
        assert stats["masked_fraction"] == pytest.approx(6 / 12)
        assert stats["truncated_fraction"] == 0.0  # every token above the cap is also above the band

    # Masked, the loss is today's loss over the kept tokens alone, still divided by every completion token.
    kept = Batch(batch.input_ids, batch.attention_mask, batch.loss_mask * ~outside, batch.sampler_logprobs,
                 batch.advantages, batch.rewards)
    masked_loss, _ = grpo_loss(trainer_logprobs(batch, log_rho), batch, GRPOConfig(), correction=MIS)
    kept_loss, _ = grpo_loss(trainer_logprobs(batch, log_rho), kept, GRPOConfig(), normaliser=12.0)
    assert torch.equal(masked_loss, kept_loss)


def test_a_real_step_reports_the_shares_and_a_fully_masked_batch_changes_nothing():
    tok = build_tokenizer()
    model = build_model(ModelConfig(hidden_size=32, num_layers=2, num_heads=1, intermediate_size=64, seed=0), tok)
    batch, _ = constructed()
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    # The engine's logprobs: the model's own, off by LOG_RHO (so rho is the constructed one).
    m = batch.loss_mask > 0
    batch.sampler_logprobs = torch.zeros_like(lp)
    batch.sampler_logprobs[m] = lp[m] - LOG_RHO.flatten()
    both = CorrectionSpec(tis_cap=1.5, mask_band=(0.5, 2.0))
    stats = grpo_step(model, make_optimizer(model), batch, GRPOConfig(), correction=both, micro_batch_size=1)
    assert stats["masked_fraction"] == pytest.approx(6 / 12)
    assert stats["truncated_fraction"] == pytest.approx(2 / 12)  # the two e^0.5 = 1.65 > 1.5, inside the band
    assert stats["grad_norm"] > 0

    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    batch.sampler_logprobs = (lp - 3.0) * batch.loss_mask  # every token 20 times likelier now than to the engine
    stats = grpo_step(model, make_optimizer(model), batch, GRPOConfig(), correction=MIS)
    assert stats["masked_fraction"] == 1.0 and stats["grad_norm"] == 0.0
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))


# The fake's engine logprobs put rho between about 0.5 and 1 under the initial tiny model: band and cap cut inside.
LOOP = CorrectionSpec(tis_cap=0.7, mask_band=(0.6, 1.5))


class CorrectedCoordinator(FakeCoordinator):
    """The fake coordinator, serving a run whose description turns both corrections on; it keeps every group it
    hands out."""

    handed: dict[int, TrainingGroup]

    def info(self) -> RunInfo:
        base = super().info()
        spec = base.spec.model_copy(update={"corrections": LOOP})
        return RunInfo.signed(spec, COORDINATOR, current_version=base.current_version)

    def training_batch(self, after_id: int, limit: int, wait_s: float = 0.0) -> TrainingBatch:
        batch = super().training_batch(after_id, limit, wait_s)
        self.handed = {**getattr(self, "handed", {}), **{g.group_id: g for g in batch.groups}}
        return batch


def test_the_trainer_takes_the_corrections_from_the_run_and_reports_both_shares(tmp_path, init_ckpt):
    fake = CorrectedCoordinator(tmp_path, offsets=(0,))
    cfg = trainer_cfg(tmp_path, init_ckpt, max_steps=1, eval_every=0)
    run_trainer(cfg, client=fake)
    (_, _, m), = fake.metrics_posted
    # The shares of the groups the step trained on, under the initial weights that took the step (temperature 1).
    (line,) = read_step_log(cfg.state_dir)
    batch = build_batch([fake.handed[i] for i in line["trained"]], pad_id=fake.tok.pad_token_id)
    model, _ = load_checkpoint(init_ckpt)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    m_ = batch.loss_mask > 0
    rho = torch.exp(lp - batch.sampler_logprobs)[m_]
    low, high = LOOP.mask_band  # type: ignore[misc]
    kept = (rho >= low) & (rho <= high)
    assert 0 < m["masked_fraction"] < 1 and 0 < m["truncated_fraction"] < 1  # the shares test something
    assert m["masked_fraction"] == int((~kept).sum()) / rho.numel()
    assert m["truncated_fraction"] == int((kept & (rho > LOOP.tis_cap)).sum()) / rho.numel()

    plain = FakeCoordinator(tmp_path / "plain", offsets=(0,))
    run_trainer(trainer_cfg(tmp_path / "plain", init_ckpt, max_steps=1, eval_every=0), client=plain)
    (_, _, m), = plain.metrics_posted
    assert m["masked_fraction"] == 0.0 and m["truncated_fraction"] == 0.0


@pytest.mark.parametrize(("setting", "why"), [
    ("tis_cap=0", "tis_cap: Input should be greater than 0"),
    ("tis_cap=-1.5", "tis_cap: Input should be greater than 0"),
    ("tis_cap=inf", "tis_cap: Input should be a finite number"),
    ("mask_band=[1.2, 2.0]", "mask_band: Value error, [1.2, 2.0] must hold 0 < low < 1 < high"),
    ("mask_band=[0.0, 2.0]", "mask_band: Value error, [0.0, 2.0] must hold 0 < low < 1 < high"),
    ("mask_band=[0.5, 1.0]", "mask_band: Value error, [0.5, 1.0] must hold 0 < low < 1 < high"),
    ("mask_band=[2.0, 0.5]", "mask_band: Value error, [2.0, 0.5] must hold 0 < low < 1 < high"),
])
def test_the_run_description_refuses_bad_corrections_in_one_line(setting, why):
    with pytest.raises(ConfigError) as e:
        load_config(CoordinatorConfig, None, [f"run.corrections.{setting}"])
    header, *reasons = str(e.value).split("\n")
    assert len(reasons) == 1 and reasons[0].strip().startswith(f"run.corrections.{why}"), str(e.value)


def test_good_corrections_are_taken_and_signed_with_the_run():
    run = load_config(CoordinatorConfig, None, ["run.corrections.tis_cap=2", "run.corrections.mask_band=[0.5, 2]"]
                      ).run
    assert run.corrections == CorrectionSpec(tis_cap=2.0, mask_band=(0.5, 2.0))
    assert run.mismatch(RunSpec()) is not None and "corrections" in run.mismatch(RunSpec())
