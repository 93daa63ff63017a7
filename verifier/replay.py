"""Replay of the protocol's sampling rule: every sampled token must be the rule's sample of the recomputed logits.

A node samples token i by the two-level Gumbel-max of `protocol.sampling` (a block of the vocabulary, then a token
in it). The verifier recomputes z in one prefill and checks each token. Its logits differ from the engine's by
floating-point error, so a token is excused only where its gap (`protocol.sampling.replay_tokens`: how far
its block's and its own perturbed score are from the best) is within `tie_margin`, which happens at near-ties only.
Calibration of the margin: see `verifier.config.Tolerances`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarmrl.protocol import sampling


@dataclass(frozen=True)
class ReplayResult:
    max_gap: float
    """Largest `protocol.sampling.replay_tokens` over the rollout; 0 when all replay exactly."""
    worst_position: int
    mismatches: int
    """Tokens that are not the exact argmax (some may be excused near-ties)."""


def replay(logits: torch.Tensor, tokens: list[int], seed: int, temperature: float) -> ReplayResult:
    """Replay one rollout: `logits` [n, vocab] recomputed by the verifier, `tokens` the n sampled ids."""
    return replay_many([logits], [tokens], [seed], [temperature])[0]


def replay_many(logits: list[torch.Tensor], tokens: list[list[int]], seeds: list[int],
                temperatures: list[float]) -> list[ReplayResult]:
    """`replay` of many rollouts (each non-empty) at once: one noise computation over all their tokens."""
    lens = torch.tensor([len(t) for t in tokens], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(tokens)), lens)
    starts = torch.cumsum(lens, 0) - lens
    positions = torch.arange(int(lens.sum())) - starts[rows]
    taken = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long)
    gaps = sampling.replay_tokens(torch.cat(logits), taken, torch.tensor(seeds, dtype=torch.int64)[rows],
                                  positions, torch.tensor(temperatures, dtype=torch.float64)[rows]).gaps.tolist()
    out = []
    for start, n in zip(starts.tolist(), lens.tolist(), strict=True):
        g = gaps[start:start + n]
        worst = max(range(n), key=g.__getitem__)
        out.append(ReplayResult(max_gap=g[worst], worst_position=worst, mismatches=sum(x > 0 for x in g)))
    return out
