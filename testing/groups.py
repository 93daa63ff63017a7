"""Building protocol groups from plain lists, for tests and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from swarmrl.protocol.groupsig import sign_group
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.leases import Lease, LeasedPrompt
from swarmrl.protocol.messages import PendingGroup, Rollout, RolloutGroup, TrainingGroup
from swarmrl.protocol.run import SamplingSpec
from swarmrl.protocol.signing import pool_id

LOCAL_RUN = "local"


def training_group(*, group_id: int, policy_version: int, prompt_ids: Sequence[int],
                   completions: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]],
                   rewards: Sequence[float], finish_reasons: Sequence[str] | None = None,
                   pool: str | None = None) -> TrainingGroup:
    """A TrainingGroup whose rollouts are `completions` with their `logprobs` (seeds 0..n-1), signed by
    `local_node()` for `pool` (default `local_pool()`) under lease `local<group_id>`."""
    reasons = list(finish_reasons) if finish_reasons is not None else ["stop"] * len(completions)
    rollouts = [Rollout(seed=i, completion_ids=list(c), logprobs=list(lp), finish_reason=f)  # type: ignore[arg-type]
                for i, (c, lp, f) in enumerate(zip(completions, logprobs, reasons, strict=True))]
    lease_id = f"local{group_id}"
    group = sign_group(local_node(), RolloutGroup(prompt_id=f"p{group_id}", prompt_ids=list(prompt_ids),
                                                  rollouts=rollouts),
                       lease_id=lease_id, policy_version=policy_version, pool=pool or local_pool())
    return TrainingGroup(group_id=group_id, policy_version=policy_version, rewards=list(rewards), group=group,
                         lease_id=lease_id, node_key=local_node().public_key_hex)


@cache
def local_coordinator() -> Identity:
    """The key that signs the leases of groups built here, outside any pool (one per process)."""
    return Identity.generate()


@cache
def local_node() -> Identity:
    """The node key that signs the groups built here (one per process)."""
    return Identity.generate()


def local_pool() -> str:
    return pool_id(LOCAL_RUN, local_coordinator().public_key_hex)


def pending_group(*, group_id: int, prompt_text: str, answer: str, sampling: SamplingSpec, seeds: Sequence[int],
                  group: RolloutGroup, node_id: str | None = None, policy_version: int = 0,
                  lease_version: int | None = None, draw: float = 0.0, **kw: int) -> PendingGroup:
    """A PendingGroup as a coordinator hands it out: judged against a lease of `prompt_text` with `seeds` and
    `sampling`, signed by `local_coordinator()` for `local_pool()`; the group signed by `local_node()` (its node
    signature verifies when `node_id` is left to be that node's). `draw` 0 is a full check for any p > 0."""
    node_id = local_node().node_id if node_id is None else node_id
    lease = Lease.issue(local_coordinator(), local_pool(), lease_id=f"local{group_id}", node_id=node_id,
                        policy_version=policy_version if lease_version is None else lease_version, expires_at=0.0,
                        sampling=sampling, prompts=[LeasedPrompt(prompt_id=group.prompt_id, text=prompt_text,
                                                                 seeds=list(seeds))])
    group = sign_group(local_node(), group, lease_id=lease.lease_id, policy_version=policy_version, pool=local_pool())
    return PendingGroup(group_id=group_id, node_id=node_id, node_key=local_node().public_key_hex, answer=answer,
                        lease=lease.excerpt(group.prompt_id), policy_version=policy_version, group=group, draw=draw,
                        **kw)
