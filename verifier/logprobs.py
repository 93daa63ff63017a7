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


def policy_logprobs(logits: torch.Tensor, tokens: list[int], temperature: float | torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T)[token] at each sampled token, float64 [n] (T one number, or one per row)."""
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(torch.float64).reshape(-1, 1)
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0]


def compare_logprobs(logits: torch.Tensor, tokens: list[int], claimed: list[float],
                     temperature: float) -> LogprobResult:
    """Largest |claimed - recomputed| over one rollout (NaN or inf claims count as infinitely far)."""
    return compare_logprobs_many([logits], [tokens], [claimed], [temperature])[0]


def compare_logprobs_many(logits: list[torch.Tensor], tokens: list[list[int]], claimed: list[list[float]],
                          temperatures: list[float]) -> list[LogprobResult]:
    """`compare_logprobs` of many rollouts (each non-empty) at once."""
    lens = [len(t) for t in tokens]
    if [len(c) for c in claimed] != lens:
        raise ValueError("every rollout needs one claimed logprob per token")
    temps = torch.repeat_interleave(torch.tensor(temperatures, dtype=torch.float64), torch.tensor(lens))
    ref = policy_logprobs(torch.cat(logits), [t for ts in tokens for t in ts], temps)
    diff = (torch.tensor([c for cs in claimed for c in cs], dtype=torch.float64) - ref).abs()
    diff = torch.nan_to_num(diff, nan=float("inf")).tolist()
    out, start = [], 0
    for n in lens:
        d = diff[start:start + n]
        worst = max(range(n), key=d.__getitem__)
        out.append(LogprobResult(max_abs_diff=d[worst], worst_position=worst))
        start += n
    return out
