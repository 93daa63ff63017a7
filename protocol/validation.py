"""The invariants of a rollout group, each checked by one function that every role calls where it must.

- `staleness_problem`: a group generated with policy version v is usable against reference version r (the
  lease's version for the verifier, the coordinator's current version at submission, the trainer's version
  when it trains) iff r - k <= v <= r, with k the run's `max_staleness`. Nodes use it to know whether the
  weights they hold are recent enough for a lease.
- `group_problem`: the shape of a submitted group against what was leased: one rollout per leased seed, one
  logprob per token, lengths within the run's max_tokens (turn lengths that fit, for multi-turn episodes),
  token ids that can be token ids, logprobs that can be logprobs. The coordinator calls it on every submission,
  so everything behind it (the verifier's checks, the trainer) sees only groups of this shape; what needs the
  model's tokenizer (prompt tokens, vocabulary, stop tokens, termination, environment turns) is the verifier's.
- `version_spans_problem`: with in-flight updates (`SamplingSpec.in_flight_updates`) a group's tokens come from
  several versions, one per span (`RolloutGroup.version_spans`); staleness is judged by the oldest (the
  submission's policy_version), and the newest may be no newer than the newest version published, nor more than k
  versions after the oldest.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from swarmrl.protocol.episodes import turns_problem
from swarmrl.protocol.messages import RolloutGroup
from swarmrl.protocol.run import SamplingSpec


def staleness_problem(version: int, reference: int, max_staleness: int) -> str | None:
    """Why a group of policy `version` cannot be used against `reference`, or None when it can."""
    accepted = f"accepted: {max(reference - max_staleness, 0)}..{reference}"
    if version > reference:
        return f"policy version {version} is newer than {reference} ({accepted})"
    if version < reference - max_staleness:
        return f"policy version {version} is more than {max_staleness} versions behind {reference} ({accepted})"
    return None


def is_fresh(version: int, reference: int, max_staleness: int) -> bool:
    """`staleness_problem(...) is None`."""
    return staleness_problem(version, reference, max_staleness) is None


def version_spans_problem(group: RolloutGroup, policy_version: int, max_staleness: int,
                          newest_published: int | None = None) -> str | None:
    """Why the version spans of `group`, of a submission at `policy_version`, cannot be, or None. With
    `newest_published` (the coordinator's current version), a span of a later version is a problem too."""
    return spans_problem(group.span_versions(policy_version), policy_version, max_staleness, newest_published)


def spans_problem(spans: Sequence[tuple[int, int]], policy_version: int, max_staleness: int,
                  newest_published: int | None = None) -> str | None:
    """`version_spans_problem` of a group whose spans (`RolloutGroup.span_versions`) are `spans`."""
    oldest, newest = spans[0][1], spans[-1][1]
    if oldest != policy_version:
        return f"the first version span is of version {oldest}, the submission's policy_version is {policy_version}"
    if newest - oldest > max_staleness:
        return f"version spans from {oldest} to {newest}: more than max_staleness {max_staleness} versions apart"
    if newest_published is not None and newest > newest_published:
        return f"a version span of version {newest}, newer than the newest published {newest_published}"
    return None


def group_problem(group: RolloutGroup, seeds: Sequence[int], sampling: SamplingSpec) -> str | None:
    """Why `group` does not have the shape of a group leased with `seeds` and `sampling`, or None."""
    if len(group.rollouts) != sampling.group_size:
        return f"expected {sampling.group_size} rollouts, got {len(group.rollouts)}"
    if Counter(r.seed for r in group.rollouts) != Counter(seeds):
        return "rollout seeds do not match the leased seeds"
    # Builtins over whole lists (min, max, map): a coordinator checks every token of every submission.
    if len(group.version_spans) > 1:
        if not sampling.in_flight_updates:
            return "version spans, but this run has no in-flight updates (sampling.in_flight_updates)"
        longest = max(len(r.completion_ids) for r in group.rollouts)
        if group.version_spans[-1][0] >= longest:
            return f"a version span starts at token {group.version_spans[-1][0]}, past every rollout's last token"
    if group.prompt_ids and min(group.prompt_ids) < 0:
        return "negative token id in the prompt"
    for i, r in enumerate(group.rollouts):
        if not r.completion_ids:
            return f"rollout {i}: empty completion"
        if len(r.logprobs) != len(r.completion_ids):
            return f"rollout {i}: {len(r.logprobs)} logprobs for {len(r.completion_ids)} tokens"
        if len(r.completion_ids) > sampling.episode_tokens:
            cap = "max_tokens" if sampling.max_turns == 1 else "the episode's max_episode_tokens"
            return f"rollout {i}: {len(r.completion_ids)} tokens exceed {cap} {sampling.episode_tokens}"
        if (problem := turns_problem(r.turns, len(r.completion_ids), sampling.max_turns, sampling.max_tokens)):
            return f"rollout {i}: {problem}"
        if min(r.completion_ids) < 0:
            return f"rollout {i}: negative token id"
        if not all(map(math.isfinite, r.logprobs)) or max(r.logprobs) > 0.0:
            return f"rollout {i}: logprobs must be finite and <= 0"
    return None
