"""Building protocol groups from plain lists, for tests and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

from swarmrl.protocol.messages import Rollout, RolloutGroup, TrainingGroup


def training_group(*, group_id: int, policy_version: int, prompt_ids: Sequence[int],
                   completions: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]],
                   rewards: Sequence[float], finish_reasons: Sequence[str] | None = None) -> TrainingGroup:
    """A TrainingGroup whose rollouts are `completions` with their `logprobs` (seeds 0..n-1)."""
    reasons = list(finish_reasons) if finish_reasons is not None else ["stop"] * len(completions)
    rollouts = [Rollout(seed=i, completion_ids=list(c), logprobs=list(lp), finish_reason=f)  # type: ignore[arg-type]
                for i, (c, lp, f) in enumerate(zip(completions, logprobs, reasons, strict=True))]
    return TrainingGroup(group_id=group_id, policy_version=policy_version, rewards=list(rewards),
                         group=RolloutGroup(prompt_id=f"p{group_id}", prompt_ids=list(prompt_ids), rollouts=rollouts))
