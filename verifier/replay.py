"""Replay of the protocol's sampling rule: every sampled token must be the argmax of the perturbed scores.

A node samples token i as argmax_v(z_v / T + g(seed, i, v)) (`protocol.sampling`). The verifier recomputes
z in one prefill and checks each token. Its logits differ from the engine's by floating-point error, so a
token is excused only where its perturbed score is within `tie_margin` of the best one, which happens at
near-ties only. Calibration of the margin: see `verifier.config.Tolerances`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol import sampling


@dataclass(frozen=True)
class ReplayResult:
    max_gap: float
    """Largest (best perturbed score - the sampled token's score) over the rollout; 0 when all replay exactly."""
    worst_position: int
    mismatches: int
    """Tokens that are not the exact argmax (some may be excused near-ties)."""


def replay(logits: torch.Tensor, tokens: list[int], seed: int, temperature: float) -> ReplayResult:
    """Replay one rollout: `logits` [n, vocab] recomputed by the verifier, `tokens` the n sampled ids."""
    n = len(tokens)
    scores = sampling.perturbed_scores(logits, torch.full((n,), seed, dtype=torch.int64), torch.arange(n),
                                       temperature)
    picked = scores.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0]
    gaps = scores.max(dim=-1).values - picked
    worst = int(gaps.argmax())
    return ReplayResult(max_gap=float(gaps[worst]), worst_position=worst, mismatches=int((gaps > 0).sum()))
