"""The operator's overview (GET /v1/overview, the dashboard, /metrics): group outcomes and rejection reasons,
node states, checkpoint spread and the ledger's totals, each from one aggregate query in one read transaction.

A node is `banned`, else `gone` when it has not been heard from (any signed request) for `node_gone_after_s`,
else `live`. Spread counts live, unbanned nodes by the newest version they say they hold (an untrusted
self-report; a version above the current one is shown as it was reported).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from sqlalchemy import Double, bindparam, case, func, select

from swarmrl.coordinator.checkpoints import current_version
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.schema import nodes, rollout_groups
from swarmrl.coordinator.db.store import Store, Tx
from swarmrl.coordinator.ledger import totals
from swarmrl.coordinator.verification import group_counts
from swarmrl.coordinator.watchdog import Watchdog
from swarmrl.protocol.overview import MAX_REASONS, MAX_SPREAD_VERSIONS, Overview, ReasonCount, VersionSpread

DISTINCT_REASONS_READ = 1000
"""The most frequent distinct reason texts read per overview; their kinds are then counted."""
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")

_n, _g = nodes.c, rollout_groups.c
_cutoff = bindparam("b_cutoff", type_=Double)
_STATE = case((_n.banned, "banned"), (_n.last_seen < _cutoff, "gone"), else_="live")
_NODE_STATES = select(_STATE.label("state"), func.count()).group_by(_STATE)
_SPREAD = (select(_n.held_version, func.count()).where(_n.banned.is_(False), _n.last_seen >= _cutoff)
           .group_by(_n.held_version).order_by(_n.held_version.desc()).limit(MAX_SPREAD_VERSIONS))
_REASONS = (select(_g.reason, func.count().label("n")).where(_g.status == "rejected").group_by(_g.reason)
            .order_by(func.count().desc()).limit(DISTINCT_REASONS_READ))


def reason_kind(reason: str) -> str:
    """A reason with its numbers replaced by '#', so "rollout 3: ..." and "rollout 5: ..." count as one kind."""
    return _NUMBER.sub("#", reason.strip().splitlines()[0] if reason.strip() else "(no reason given)")[:200]


def node_states(tx: Tx, cutoff: float) -> dict[str, int]:
    """Nodes by state (live, gone, banned); gone: last seen before `cutoff`."""
    states = {"live": 0, "gone": 0, "banned": 0}
    for state, n in tx.execute(_NODE_STATES, {"b_cutoff": cutoff}):
        states[state] = int(n)
    return states


def spread(tx: Tx, cutoff: float) -> list[VersionSpread]:
    """Live, unbanned nodes per held version, newest first."""
    return [VersionSpread(version=v, nodes=int(n)) for v, n in tx.execute(_SPREAD, {"b_cutoff": cutoff})]


def reasons(tx: Tx) -> list[ReasonCount]:
    """Rejected groups per kind of reason (`reason_kind`), most frequent first."""
    kinds: dict[str, ReasonCount] = {}
    for text, n in tx.execute(_REASONS):
        kind = reason_kind(text)
        seen = kinds.get(kind)
        kinds[kind] = ReasonCount(reason=kind, groups=int(n) + (seen.groups if seen else 0),
                                  example=seen.example if seen else text[:500])
    return sorted(kinds.values(), key=lambda r: (-r.groups, r.reason))[:MAX_REASONS]


class Overviews:
    """Builds overviews of the store for the run in `config`."""

    def __init__(self, store: Store, config: CoordinatorConfig, clock: Callable[[], float],
                 watchdog: Watchdog | None = None):
        self.store, self.clock, self.gone_after_s = store, clock, config.node_gone_after_s
        self.watchdog = watchdog
        # As the pool is announced (`pools.config.PoolConfig.name`), or the run id when it is not.
        self.pool_name = (config.pool.name or config.run.run_id.lower()) if config.pool is not None \
            else config.run.run_id

    def overview(self) -> Overview:
        now = self.clock()
        cutoff = now - self.gone_after_s

        def read(tx: Tx) -> Overview:
            counts = group_counts(tx)
            groups, tokens, issued = totals(tx)
            return Overview(now=now, current_version=current_version(tx),
                            groups={"pending": counts["pending"] - counts["held"], "held": counts["held"],
                                    "accepted": counts["accepted"], "rejected": counts["rejected"]},
                            reasons=reasons(tx), nodes=node_states(tx, cutoff), gone_after_s=self.gone_after_s,
                            spread=spread(tx, cutoff), ledger_groups=groups, ledger_tokens=tokens, receipts=issued)

        ov = self.store.read(read)
        ov.pool_name = self.pool_name
        if self.watchdog is not None:
            ov.training = self.watchdog.training()
        return ov
