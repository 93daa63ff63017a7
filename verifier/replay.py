"""Replay of the protocol's sampling rule: every sampled token must be the argmax of the perturbed scores.

A node samples token i as argmax_v(z_v / T + g(seed, i, v)) (`protocol.sampling`). The verifier recomputes
z in one prefill and checks each token. Its logits differ from the engine's by floating-point error, so a
token is excused only where its perturbed score is within `tie_margin` of the best one, which happens at
near-ties only. Calibration of the margin: see `verifier.config.Tolerances`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarmrl.protocol import sampling


@dataclass(frozen=True)
class ReplayResult:
    max_gap: float
    """Largest (best perturbed score - the sampled token's score) over the rollout; 0 when all replay exactly."""
    worst_position: int
    mismatches: int
    """Tokens that are not the exact argmax (some may be excused near-ties)."""


def replay(logits: torch.Tensor, tokens: list[int], seed: int, temperature: float) -> ReplayResult:
    """Replay one rollout: `logits` [n, vocab] recomputed by the verifier, `tokens` the n sampled ids."""
    return replay_many([logits], [tokens], [seed], [temperature])[0]


def replay_gaps(logits: torch.Tensor, tokens: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                temperatures: torch.Tensor) -> torch.Tensor:
    """Per row of `logits` [R, vocab] (one completion position each): best perturbed score - the score of the
    sampled token (0 when it is the argmax), float64 [R]. Each row has its own seed, position and temperature."""
    scores = sampling.perturbed_scores(logits, seeds, positions, temperatures)
    return scores.max(dim=-1).values - scores.gather(-1, tokens[:, None].to(scores.device))[:, 0]


def replay_many(logits: list[torch.Tensor], tokens: list[list[int]], seeds: list[int],
                temperatures: list[float]) -> list[ReplayResult]:
    """`replay` of many rollouts (each non-empty) at once: one noise computation over all their tokens."""
    lens = torch.tensor([len(t) for t in tokens], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(tokens)), lens)
    starts = torch.cumsum(lens, 0) - lens
    positions = torch.arange(int(lens.sum())) - starts[rows]
    taken = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long)
    gaps = replay_gaps(torch.cat(logits), taken, torch.tensor(seeds, dtype=torch.int64)[rows], positions,
                       torch.tensor(temperatures, dtype=torch.float64)[rows]).tolist()
    out = []
    for start, n in zip(starts.tolist(), lens.tolist(), strict=True):
        g = gaps[start:start + n]
        worst = max(range(n), key=g.__getitem__)
        out.append(ReplayResult(max_gap=g[worst], worst_position=worst, mismatches=sum(x > 0 for x in g)))
    return out
