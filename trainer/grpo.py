"""GRPO, off-policy, the INTELLECT-2 way. Pure functions, read top to bottom.

1. Every verified group is one prompt with G rollouts and trusted rewards. Its advantages are the rewards
   normalised inside the group: A = (r - mean) / (std + eps). A group whose rewards are all equal has
   A = 0 everywhere and teaches nothing: it is filtered out.
2. Prompt + completion become one right-padded row; only completion tokens carry loss.
3. The rollouts were sampled by an older policy (up to k versions stale) whose per-token logprobs came
   with them. The importance ratio of a token is exp(logp_new - logp_sampler).
4. Loss per token: -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A), and for A < 0 the ratio
   counts at most `clip_ratio_max` (INTELLECT-2's two-sided clipping: without it a token the new policy
   likes far more than the sampler did gets an unbounded push down). Optionally + kl_coef * KL(k3) to a
   reference policy. Averaged over every completion token of the batch (token-mean).
5. Mismatch corrections (the run's `corrections`, both off by default), for engines whose probabilities are not the
   trainer's (bf16 on GPUs; on the fp32 CPU path they agree to 1e-6). See `grpo_loss`.

Everything here is single-process; `trainer.distributed` runs the same step sharded with FSDP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from swarmrl.protocol.episodes import spans
from swarmrl.protocol.messages import TrainingGroup
from swarmrl.protocol.run import CorrectionSpec


class GRPOConfig(BaseModel):
    """Knobs of the advantages and the loss (the trainer config's `[loss]` table).

    The sampler's temperature is not one of them: it is the run's (`RunSpec.sampling`), handed to `grpo_step`.
    """

    model_config = ConfigDict(extra="forbid")

    clip_low: float = Field(0.2, ge=0, lt=1, description="The ratio is clipped below at 1 - clip_low (A < 0).")
    clip_high: float = Field(0.28, ge=0, description="The ratio is clipped above at 1 + clip_high (A > 0); higher "
                             "than clip_low, as in DAPO.")
    clip_ratio_max: float = Field(4.0, gt=1, description="For A < 0 the ratio counts at most this much "
                                  "(INTELLECT-2's two-sided cap).")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL to the initial model; 0: no reference model.")
    filter_zero_advantage: bool = Field(True, description="Skip groups whose rewards are all equal; they carry no "
                                        "signal (counted, not trained).")
    adv_eps: float = Field(1e-4, gt=0, description="Advantage = (r - mean) / (std + adv_eps) within a group.")


# -- 1. advantages ----------------------------------------------------------------------------------


def group_advantages(rewards: Tensor, eps: float = 1e-4) -> Tensor:
    """(r - mean) / (std + eps) over one group's rewards: mean 0, std ~1; all-equal rewards give all zeros.

    The population std (no Bessel correction) keeps a group of any size finite.
    """
    r = rewards.double()
    return ((r - r.mean()) / (r.std(correction=0) + eps)).float()


def is_informative(group: TrainingGroup) -> bool:
    """True when the group's rewards are not all equal, i.e. its advantages are not all zero."""
    return len(set(group.rewards)) > 1


def filter_groups(groups: Sequence[TrainingGroup], filter_zero_advantage: bool = True
                  ) -> tuple[list[TrainingGroup], list[TrainingGroup]]:
    """Split groups into (trainable, dropped): dropped are the zero-advantage ones, if asked. (Their shape was
    checked at submission, `protocol.validation.group_problem`, and TrainingGroup holds one reward per rollout.)"""
    keep, drop = [], []
    for g in groups:
        (keep if is_informative(g) or not filter_zero_advantage else drop).append(g)
    return keep, drop


# -- 2. tensors -------------------------------------------------------------------------------------


@dataclass
class Batch:
    """Padded training rows, one per rollout. Position t of the [B, L-1] tensors is about token t+1."""

    input_ids: Tensor
    """[B, L] prompt + completion, right-padded."""
    attention_mask: Tensor
    """[B, L] 1 on real tokens."""
    loss_mask: Tensor
    """[B, L-1] float, 1 where the predicted token is a completion token."""
    sampler_logprobs: Tensor
    """[B, L-1] the sampler's logprob of each predicted completion token (0 elsewhere)."""
    advantages: Tensor
    """[B] the rollout's group-normalised advantage."""
    rewards: Tensor
    """[B] the trusted reward (for metrics only)."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def rows(self, index: slice | Tensor) -> Batch:
        """The sub-batch of the given rows (a slice or an index tensor)."""
        return Batch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def to(self, device: torch.device | str) -> Batch:
        """The same batch on `device` (itself when already there)."""
        return Batch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def micro_batches(self, size: int) -> list[Batch]:
        """Consecutive sub-batches of at most `size` rows; `size` 0 means the whole batch."""
        if size <= 0 or size >= len(self):
            return [self]
        return [self.rows(slice(i, i + size)) for i in range(0, len(self), size)]


def build_batch(groups: Sequence[TrainingGroup], pad_id: int, adv_eps: float = 1e-4) -> Batch:
    """Right-padded rows for every rollout of `groups`; loss only on the completion tokens the model sampled (in a
    multi-turn episode, not on the environment's turns)."""
    rows: list[list[int]] = []
    starts: list[int] = []
    env_spans: list[list[tuple[int, int]]] = []
    lps: list[list[float]] = []
    advs: list[Tensor] = []
    rewards: list[float] = []
    for g in groups:
        advs.append(group_advantages(torch.tensor(g.rewards), adv_eps))
        rewards.extend(g.rewards)
        prompt = g.group.prompt_ids
        for r in g.group.rollouts:
            rows.append(list(prompt) + list(r.completion_ids))
            starts.append(len(prompt))
            lps.append(r.logprobs)
            env_spans.append([(a, b) for a, b, is_model in spans(r.turns, len(r.completion_ids)) if not is_model])
    if not rows:
        raise ValueError("no rollouts to build a batch from")
    B, L = len(rows), max(len(r) for r in rows)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    loss_mask = torch.zeros((B, L - 1))
    sampler_logprobs = torch.zeros((B, L - 1))
    for i, (row, start, lp) in enumerate(zip(rows, starts, lps, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        # Token j (j >= start) is predicted at position j - 1.
        loss_mask[i, start - 1 : len(row) - 1] = 1.0
        for a, b in env_spans[i]:
            loss_mask[i, start + a - 1 : start + b - 1] = 0.0
        sampler_logprobs[i, start - 1 : len(row) - 1] = torch.tensor(lp, dtype=torch.float32)
    return Batch(input_ids, attention_mask, loss_mask, sampler_logprobs, torch.cat(advs),
                 torch.tensor(rewards, dtype=torch.float32))


# -- 3. logprobs under the current policy -----------------------------------------------------------


def token_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0
                   ) -> tuple[Tensor, Tensor]:
    """([B, L-1] logprob of each next token, [B, L-1] entropy of each next-token distribution, detached).

    Logits are divided by the sampler's temperature so the logprobs are comparable with the sampler's.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    taken = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return taken, entropy


# -- 4. the loss ------------------------------------------------------------------------------------

# Stats are returned as sums so that micro-batches and ranks can simply be added; `finish_stats` turns
# them into means. Order of the sums vector:
STAT_KEYS = ("loss", "tokens", "clipped", "capped", "abs_ratio_dev", "entropy", "kl", "truncated", "masked")

NO_CORRECTION = CorrectionSpec()


def grpo_loss(new_logprobs: Tensor, batch: Batch, cfg: GRPOConfig, *, normaliser: float | Tensor | None = None,
              ref_logprobs: Tensor | None = None, entropy: Tensor | None = None,
              correction: CorrectionSpec = NO_CORRECTION) -> tuple[Tensor, Tensor]:
    """(loss, stat sums) of one (micro-)batch.

    loss = sum over completion tokens of the per-token loss, divided by `normaliser` (default: this
    batch's token count). Pass the whole step's token count when accumulating micro-batches or ranks, so
    the sum of their losses is the token-mean over the whole step.

    Mismatch corrections act on rho = pi_trainer / pi_engine of each token, pi_engine being the node's logprob. The
    trainer's probability under the version that generated the token is not available (the trainer keeps only its
    current weights), so pi_trainer is the current policy's, detached: the same for a group sampled by the current
    version, and carrying the policy's drift too for a stale one (prime-rl does the same). In value rho is the
    ratio the clipping above acts on, since the engine is the behaviour policy.
    - `mask_band` (MIS, IcePop): a token whose rho leaves [low, high] is dropped: no loss, no gradient. The
      normaliser stays the step's token count, so micro-batches and ranks still add up.
    - `tis_cap` (TIS, the decoupled objective of verl's rollout correction and AReaL): the ratio is split into
      pi_theta / pi_trainer, which the clip band bounds, times the behaviour weight pi_trainer / pi_engine = rho,
      detached and truncated at the cap. The trainer takes one optimizer step per batch, so the first factor is 1 in
      value (its gradient is that of log pi_theta) and neither the clip band nor clip_ratio_max binds: the mismatch
      and the staleness no longer silence tokens by clipping (clip_fraction reads 0), and min(rho, cap) bounds each
      token's weight instead. Both on: the band drops tokens first, the cap weighs the rest.
    """
    mask = batch.loss_mask
    adv = batch.advantages[:, None].to(new_logprobs.dtype)
    # Clamping the log-ratio changes no gradient that survives clipping (a ratio of e^20 is clipped
    # whichever the sign of A; one of e^-20 has ~0 gradient), and keeps exp finite on padding and junk.
    log_ratio = ((new_logprobs - batch.sampler_logprobs) * mask).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    rho = ratio.detach()  # pi_trainer / pi_engine, pi_trainer being the current policy (see above)
    keep = mask  # the tokens that carry loss; the corrections off, every completion token
    if correction.mask_band is not None:
        low, high = correction.mask_band
        keep = mask * ((rho >= low) & (rho <= high))
    surrogate_ratio, weight = ratio, None
    if correction.tis_cap is not None:
        # pi_theta / pi_trainer: exactly 1 in value, with the gradient of log pi_theta.
        surrogate_ratio = torch.exp((new_logprobs - new_logprobs.detach()) * mask)
        weight = rho.clamp(max=correction.tis_cap)
    unclipped = surrogate_ratio * adv
    clipped = surrogate_ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv
    objective = torch.minimum(unclipped, clipped)
    # For A < 0, min() above picks ratio * A when the ratio is large, which is unbounded below: cap the
    # ratio at clip_ratio_max (a constant, so capped tokens get no gradient).
    objective = torch.where(adv < 0, torch.maximum(objective, cfg.clip_ratio_max * adv), objective)
    if weight is not None:
        objective = weight * objective
    per_token = -objective

    kl = torch.zeros_like(new_logprobs)
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        # k3 estimator of KL(new || ref): exp(d) - d - 1 with d = ref - new; >= 0, unbiased, low variance.
        d = (ref_logprobs - new_logprobs).clamp(-20.0, 20.0)
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + cfg.kl_coef * kl

    tokens = mask.sum()
    if normaliser is None:
        normaliser = tokens.clamp(min=1.0)
    loss = (per_token * keep).sum() / normaliser

    with torch.no_grad():
        r = surrogate_ratio.detach()
        # Tokens whose gradient clipping removed: the clipped branch is the smaller one, or the cap holds.
        a = adv.expand_as(r)
        was_clipped = ((a > 0) & (r > 1.0 + cfg.clip_high)) | ((a < 0) & (r < 1.0 - cfg.clip_low))
        was_capped = (a < 0) & (r > cfg.clip_ratio_max)
        ent = entropy if entropy is not None else torch.zeros_like(r)
        truncated = rho > correction.tis_cap if correction.tis_cap is not None else torch.zeros_like(keep)
        sums = torch.stack([
            loss.detach().double(),
            tokens.double(),
            (((was_clipped | was_capped).float()) * keep).sum().double(),
            (was_capped.float() * keep).sum().double(),
            ((rho - 1.0).abs() * mask).sum().double(),
            (ent * mask).sum().double(),
            (kl.detach() * mask).sum().double(),
            (truncated.float() * keep).sum().double(),
            (mask - keep).sum().double(),
        ])
    return loss, sums


def finish_stats(sums: Tensor) -> dict[str, float]:
    """Means per completion token (and the step's total loss) from the summed stats of `grpo_loss`.

    truncated_fraction: share of the tokens kept whose TIS weight the cap cut, over all completion tokens;
    masked_fraction: share dropped by the MIS band. Both 0 while the corrections are off.
    """
    s = dict(zip(STAT_KEYS, sums.tolist(), strict=True))
    n = max(s["tokens"], 1.0)
    return {
        "loss": s["loss"],
        "tokens": s["tokens"],
        "clip_fraction": s["clipped"] / n,
        "cap_fraction": s["capped"] / n,
        "mean_abs_ratio_minus_1": s["abs_ratio_dev"] / n,
        "entropy": s["entropy"] / n,
        "kl": s["kl"] / n,
        "truncated_fraction": s["truncated"] / n,
        "masked_fraction": s["masked"] / n,
    }


# -- 5. one optimizer step --------------------------------------------------------------------------


def grpo_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: GRPOConfig,
    *,
    temperature: float = 1.0,
    grad_clip: float = 1.0,
    micro_batch_size: int = 0,
    ref_model: nn.Module | None = None,
    normaliser: float | None = None,
    loss_scale: float = 1.0,
    reduce_sums: Callable[[Tensor], Tensor] | None = None,
    correction: CorrectionSpec = NO_CORRECTION,
) -> dict[str, float]:
    """One optimizer step of GRPO on `batch`; returns the step's stats (means per token, loss, grad_norm).
    `temperature` is the sampler's: its logprobs are log_softmax(logits / T), so ours must be too. `correction` is
    the run's (`RunSpec.corrections`).

    `normaliser`, `loss_scale` and `reduce_sums` exist for data parallelism (see trainer.distributed): the
    token count of the global batch, the factor that undoes the gradient averaging across ranks, and an
    all-reduce of the stat sums. Left at their defaults this is the plain single-process step.
    """
    model.train()
    if normaliser is None:
        normaliser = max(float(batch.num_tokens), 1.0)
    optimizer.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    sums = torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=device)
    for mb in batch.micro_batches(micro_batch_size):
        mb = mb.to(device)
        new_lp, entropy = token_logprobs(model, mb.input_ids, mb.attention_mask, temperature)
        ref_lp = None
        if cfg.kl_coef > 0:
            if ref_model is None:
                raise ValueError("kl_coef > 0 needs a ref_model")
            with torch.no_grad():
                ref_lp, _ = token_logprobs(ref_model, mb.input_ids, mb.attention_mask, temperature)
        loss, s = grpo_loss(new_lp, mb, cfg, normaliser=normaliser, ref_logprobs=ref_lp, entropy=entropy,
                            correction=correction)
        (loss * loss_scale).backward()
        sums += s
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP: every rank holds the same global norm
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if reduce_sums is not None:
        sums = reduce_sums(sums)
    stats = finish_stats(sums.cpu())
    stats["grad_norm"] = float(grad_norm)
    return stats


def make_optimizer(model: nn.Module, lr: float = 3e-4, betas: tuple[float, float] = (0.9, 0.999),
                   weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over every trainable parameter (the recipe that worked on the tiny model: lr 3e-4, wd 0)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=betas,
                             weight_decay=weight_decay)
