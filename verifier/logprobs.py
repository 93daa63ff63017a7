"""Logprob recomputation: the node's per-token logprobs must be the policy's, log_softmax(z / T)[token].

The trainer's importance ratios use these logprobs, so made-up values poison training directly; and a model
that differs from the leased one (even by 0.1% of its weights, which replay alone rarely notices) shifts them
by far more than honest floating-point error. Calibration of the tolerance: see `verifier.config.Tolerances`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogprobResult:
    max_abs_diff: float
    worst_position: int


def policy_logprobs(logits: torch.Tensor, tokens: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at each sampled token, float64 [n]."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0]


def compare_logprobs(logits: torch.Tensor, tokens: list[int], claimed: list[float],
                     temperature: float) -> LogprobResult:
    """Largest |claimed - recomputed| over one rollout (NaN or inf claims count as infinitely far)."""
    ref = policy_logprobs(logits, tokens, temperature)
    diff = (torch.tensor(claimed, dtype=torch.float64) - ref).abs()
    diff = torch.nan_to_num(diff, nan=float("inf"))
    worst = int(diff.argmax())
    return LogprobResult(max_abs_diff=float(diff[worst]), worst_position=worst)
