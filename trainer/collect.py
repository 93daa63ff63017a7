"""Step 1 of the trainer's loop: pulling a batch of fresh, verified groups from the coordinator's feed.

Reading the feed changes nothing on the coordinator: the trainer acknowledges the cursor it has consumed only
after it saved a state with that cursor (`trainer.loop`), so a trainer killed in between reads the same groups
again and trains on each exactly once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from swarmrl.protocol.groupsig import verify_group
from swarmrl.protocol.identity import node_id_from_public_key
from swarmrl.protocol.manifest import CheckpointManifest, SignedManifest
from swarmrl.protocol.messages import RunInfo, TrainingBatch, TrainingGroup
from swarmrl.protocol.signing import SignatureError
from swarmrl.protocol.validation import is_fresh
from swarmrl.runtime.client import CoordinatorError
from swarmrl.trainer.config import TrainerConfig
from swarmrl.trainer.grpo import filter_groups

log = logging.getLogger(__name__)


class TrainerClient(Protocol):
    """The coordinator calls the trainer makes (`runtime.client.CoordinatorClient` has them all)."""

    def info(self) -> RunInfo: ...

    def training_batch(self, after_id: int, limit: int, wait_s: float = 0.0) -> TrainingBatch: ...

    def ack(self, cursor: int) -> object: ...

    def upload_shard(self, sha256: str, data: bytes) -> None: ...

    def publish(self, manifest: CheckpointManifest) -> SignedManifest: ...

    def metrics(self, step: int, version: int, metrics: dict[str, float]) -> None: ...


@dataclass
class Collected:
    """The groups for one step and what was passed over to get them."""

    groups: list[TrainingGroup]
    """Trainable: fresh enough, well formed, and (if filtering) with non-zero advantages."""
    fresh: list[TrainingGroup]
    """Every fresh group seen, trainable or not (for reward metrics)."""
    cursor: int
    """The largest group id seen; the next pull starts after it."""
    consumed: list[int] = field(default_factory=list)
    """Every group id passed over, trained on or not (stale, filtered), in feed order."""
    stale: int = 0
    filtered: int = 0
    forged: int = 0
    """Groups whose node signature did not verify (passed over)."""
    idle_s: float = 0.0


def _transient(e: Exception) -> bool:
    """Worth retrying: the coordinator is unreachable or restarting, not refusing us."""
    return isinstance(e, httpx.TransportError) or (isinstance(e, CoordinatorError) and e.status >= 500)


def forged(g: TrainingGroup, pool: str) -> str | None:
    """Why `g` is not known to be what its node submitted (its node signature does not verify for `pool`), or None."""
    try:
        verify_group(g.group, node_key=g.node_key, node_id=node_id_from_public_key(g.node_key), lease_id=g.lease_id,
                     policy_version=g.policy_version, pool=pool)
    except SignatureError as e:
        return e.reason
    return None


def collect_groups(
    client: TrainerClient,
    cursor: int,
    version: int,
    cfg: TrainerConfig,
    max_staleness: int,
    stop: threading.Event | None = None,
    on_wait: Callable[[int], None] | None = None,
    *,
    pool: str,
) -> Collected | None:
    """Pull groups after `cursor` until `cfg.batch_groups` fresh ones are in; None if `stop` was set.

    A group is fresh when `protocol.validation.is_fresh` says so against `version` with the run's
    `max_staleness` (0: only groups sampled by the current weights). Of the fresh groups, the zero-advantage ones
    are filtered out of `groups`; with `fill_with_informative` they do not count towards the batch
    either, so the step always gets `batch_groups` trainable groups. A poll that finds nothing new is held by
    the coordinator for up to `long_poll_s`; rides out coordinator restarts. A group whose node signature does not
    verify for `pool` (`protocol.groupsig`: not what its node sent) is passed over, never trained on, and logged.
    """
    t0 = said = time.monotonic()
    out = Collected(groups=[], fresh=[], cursor=cursor)

    def have() -> int:
        return len(out.groups) if cfg.fill_with_informative else len(out.fresh)

    while have() < cfg.batch_groups:
        if stop is not None and stop.is_set():
            return None
        want = cfg.batch_groups - have()
        t_poll = time.monotonic()
        try:
            batch = client.training_batch(after_id=out.cursor, limit=want, wait_s=cfg.long_poll_s)
        except (httpx.TransportError, CoordinatorError) as e:
            if not _transient(e):
                raise
            log.warning("coordinator unavailable (%s); retrying", e)
            batch = TrainingBatch(current_version=-1, groups=[])
        for g in sorted(batch.groups, key=lambda g: g.group_id):
            if g.group_id <= out.cursor:  # a coordinator bug must not make us train twice on a group
                continue
            out.cursor = g.group_id
            out.consumed.append(g.group_id)
            if (why := forged(g, pool)) is not None:
                log.error("feed position %d is not the group its node signed (%s): passed over, never trained on; the "
                          "coordinator (its store or process) changed it", g.group_id, why)
                out.forged += 1
                continue
            if not is_fresh(g.policy_version, version, max_staleness):
                out.stale += 1
                continue
            out.fresh.append(g)
            keep, drop = filter_groups([g], cfg.loss.filter_zero_advantage)
            out.groups += keep
            out.filtered += len(drop)
        # We never ask for more than we still need, so every group returned was consumed above.
        if len(batch.groups) < want and have() < cfg.batch_groups:
            if on_wait is not None:
                on_wait(have())
            if time.monotonic() - said >= 30:  # why there is no step yet, in the trainer's log
                said = time.monotonic()
                log.info("no step yet: %d of %d groups (passed over: %d stale, %d with no reward spread)", have(),
                         cfg.batch_groups, out.stale, out.filtered)
            if not batch.groups and time.monotonic() - t_poll < cfg.poll_interval_s:
                # The coordinator answered at once with nothing (no long poll, or an error): do not spin.
                if stop is not None:
                    stop.wait(cfg.poll_interval_s)
                else:
                    time.sleep(cfg.poll_interval_s)
    out.idle_s = time.monotonic() - t0
    return out
