"""The watchdog: whether training moves and, when it does not, what blocks it.

Training moves when new policy versions are published. The watchdog reads, in one read transaction, what every
link of the loop waits on (docs/liveness.md) and names each link that is blocked now (`protocol.overview.Blocker`):
no checkpoint yet, the trainer or the verifiers silent, no live node, the buffer full, groups held for their nodes'
next checks; with none of those, the trainer is simply waiting for groups. It says the pool is *stalled* when no
version has been published for `stall_after_s`.

What it reports is shown on the dashboard, in GET /v1/overview and GET /v1/training (which nodes read to say why
they get no work), and in /metrics; each change of the stall is logged once. A diagnosis is kept for `cache_s`, so
asking often costs a few statements per `cache_s` per process, however many ask.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select

from swarmrl.coordinator.db.schema import (
    CURRENT_VERSION,
    FEED_READ,
    TRAINER_SEEN_AT,
    VERIFIER_SEEN_AT,
    in_flight,
    manifests,
    nodes,
    rollout_groups,
)
from swarmrl.coordinator.db.store import Store, Tx, counter
from swarmrl.coordinator.inflight import PROVEN, UNPROVEN
from swarmrl.protocol.overview import BLOCKER_TEXT, Blocker, Training

log = logging.getLogger("swarmrl.coordinator")


class WatchdogConfig(BaseModel):
    """When the watchdog calls the pool stalled and a role absent."""

    model_config = ConfigDict(extra="forbid")

    stall_after_s: float = Field(600.0, gt=0, description="No new policy version for this long: the pool is "
                                 "stalled (shown on the dashboard, in /v1/overview and /metrics, and logged).")
    absent_after_s: float = Field(120.0, gt=0, description="The trainer (or every verifier) is absent when it has "
                                  "not been heard from for this long; more than their long polls (at most 30 s).")
    cache_s: float = Field(2.0, ge=0, description="A diagnosis is reused for this long.")


_g, _n, _f = rollout_groups.c, nodes.c, in_flight.c


def diagnose(tx: Tx, now: float, started_at: float, cfg: WatchdogConfig, max_buffered: int | None,
             max_staleness: int, gone_after_s: float) -> Training:
    """What blocks training now, read in `tx` (see the module docstring). `started_at`: when this coordinator
    started (the stall clock before any publication)."""
    version = counter(tx, CURRENT_VERSION)
    last = tx.execute(select(func.max(manifests.c.published_at))).scalar()
    since = now - (float(last) if last is not None else started_at)
    blockers: list[Blocker] = []
    if version < 0:
        blockers.append(Blocker.NO_CHECKPOINT)
    if now - counter(tx, TRAINER_SEEN_AT) > cfg.absent_after_s:
        blockers.append(Blocker.TRAINER_ABSENT)
    live = tx.execute(select(func.count()).select_from(nodes).where(
        _n.banned.is_(False), _n.last_seen >= now - gone_after_s)).scalar_one()
    if live == 0:
        blockers.append(Blocker.NO_NODES)
    min_version = version - max_staleness
    fresh = _g.policy_version >= min_version
    waiting = tx.execute(select(func.count()).select_from(rollout_groups).where(
        fresh, _g.status == "pending", _g.held.is_(False))).scalar_one()
    if waiting and now - counter(tx, VERIFIER_SEEN_AT) > cfg.absent_after_s:
        blockers.append(Blocker.NO_VERIFIER)
    if max_buffered is not None and version >= 0:
        unread = tx.execute(select(func.count()).select_from(rollout_groups).where(
            fresh, _g.status == "accepted", _g.accepted_seq > counter(tx, FEED_READ))).scalar_one()
        leased = tx.execute(select(func.coalesce(func.sum(_f.n), 0)).where(
            _f.cls.in_((PROVEN, UNPROVEN)), _f.policy_version >= min_version)).scalar_one()
        if waiting + unread + int(leased) >= max_buffered:
            blockers.append(Blocker.BUFFER_FULL)
    held = tx.execute(select(func.count()).select_from(rollout_groups).where(
        fresh, _g.status == "pending", _g.held.is_(True))).scalar_one()
    stalled = since > cfg.stall_after_s
    if held and (stalled or not blockers):
        blockers.append(Blocker.HELD_AWAITING_CHECKS)
    if stalled and not blockers:
        blockers.append(Blocker.WAITING_FOR_GROUPS)
    return Training(last_step_at=None if last is None else float(last), since_last_step_s=max(since, 0.0),
                    stalled=stalled, blockers=blockers, why="; ".join(BLOCKER_TEXT[b] for b in blockers))


class Watchdog:
    """The coordinator's diagnosis of its pool, kept for `config.cache_s` (see the module docstring)."""

    def __init__(self, store: Store, config: WatchdogConfig, clock: Callable[[], float], max_buffered: int | None,
                 max_staleness: int, gone_after_s: float):
        self.store, self.config, self.clock = store, config, clock
        self._args = (config, max_buffered, max_staleness, gone_after_s)
        self.started_at = clock()
        self._lock = threading.Lock()
        self._cached: tuple[float, Training] | None = None
        self._was_stalled = False

    def training(self) -> Training:
        """The diagnosis now (at most `cache_s` old). Logs a line when the pool becomes stalled or moves again."""
        now = self.clock()
        with self._lock:
            if self._cached is not None and now - self._cached[0] < self.config.cache_s:
                return self._cached[1]
        cfg, max_buffered, max_staleness, gone_after_s = self._args
        state = self.store.read(lambda tx: diagnose(tx, now, self.started_at, cfg, max_buffered, max_staleness,
                                                    gone_after_s))
        with self._lock:
            self._cached = (now, state)
            if state.stalled != self._was_stalled:
                self._was_stalled = state.stalled
                if state.stalled:
                    log.warning("training stalled: no new version for %.0f s: %s", state.since_last_step_s,
                                state.why or "no blocker found")
                else:
                    log.info("training moves again")
        return state
