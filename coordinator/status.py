"""What the run looks like from outside: RunInfo, the status snapshot (the dashboard), and the trainer's
metrics reports, to which the coordinator adds the swarm's node idle time since the previous report."""

from __future__ import annotations

import math
from collections.abc import Callable

from sqlalchemy import select

from swarmrl.coordinator import registry
from swarmrl.coordinator.auth import Refused, Signed
from swarmrl.coordinator.checkpoints import current_version
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.rows import MetricsRow
from swarmrl.coordinator.db.schema import METRICS_REPORTS, metrics
from swarmrl.coordinator.db.store import Store, Tx, add_to_counter, load
from swarmrl.coordinator.verification import group_counts
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity

STATUS_METRICS_ROWS = 1000
# Trainer metrics the coordinator sets itself (from the nodes' heartbeat counters) when it records a report.
NODE_IDLE_METRICS = ("node_idle_s", "node_idle_frac")


def recent_metrics(tx: Tx, n: int) -> list[MetricsRow]:
    """The last `n` metrics rows, oldest first."""
    rows = tx.execute(select(metrics).order_by(metrics.c.id.desc()).limit(n))
    return [load(MetricsRow, r) for r in rows][::-1]


def last_node_totals(tx: Tx) -> tuple[float, float]:
    """The swarm's (idle, busy) totals stored with the newest metrics row; (0, 0) before the first."""
    row = tx.execute(select(metrics.c.node_idle_total, metrics.c.node_busy_total)
                     .order_by(metrics.c.id.desc()).limit(1)).first()
    return (float(row.node_idle_total), float(row.node_busy_total)) if row is not None else (0.0, 0.0)


def insert_metrics(tx: Tx, step: int, version: int, data: dict[str, float], now: float,
                   node_totals: tuple[float, float] = (0.0, 0.0)) -> None:
    """Store a metrics row with `node_totals`, the swarm's (idle, busy) totals when it was recorded."""
    tx.execute(metrics.insert().values(step=step, version=version, data=data, ts=now, node_idle_total=node_totals[0],
                                       node_busy_total=node_totals[1]))


class Status:
    """RunInfo, the status snapshot, and trainer metrics reports."""

    def __init__(self, store: Store, config: CoordinatorConfig, identity: Identity, clock: Callable[[], float]):
        self.store, self.config, self.identity, self.clock = store, config, identity, clock
        # Bootstrap multiaddrs of the checkpoint swarm's DHT, sent to nodes in RunInfo (the seed adds its own).
        self.dht_peers: list[str] = list(config.dht_peers)

    def run_info(self) -> m.RunInfo:
        return self._info(self.store.read(current_version))

    def _info(self, version: int) -> m.RunInfo:
        return m.RunInfo(spec=self.config.run, coordinator_key=self.identity.public_key_hex, current_version=version,
                         dht_peers=list(self.dht_peers))

    def snapshot(self) -> m.RunStatus:
        def read(tx: Tx) -> m.RunStatus:
            counts = group_counts(tx)
            nodes = [m.NodeStatus(node_id=n.id, name=n.name, engine=n.engine, held_version=n.held_version,
                                  groups_accepted=n.groups_accepted, groups_rejected=n.groups_rejected,
                                  banned=n.banned, last_seen=n.last_seen, checks_passed=n.checks_passed,
                                  reputation=n.reputation, idle_s=n.idle_s, busy_s=n.busy_s)
                     for n in registry.list_nodes(tx)]
            reports = [m.TrainerMetrics(step=r.step, version=r.version, metrics=r.data)
                       for r in recent_metrics(tx, STATUS_METRICS_ROWS)]
            return m.RunStatus(run=self._info(current_version(tx)), nodes=nodes,
                               groups_pending=counts["pending"] - counts["held"], groups_accepted=counts["accepted"],
                               groups_rejected=counts["rejected"], metrics=reports, groups_held=counts["held"])

        return self.store.read(read)

    def record_metrics(self, req: Signed) -> None:
        body: m.TrainerMetrics = req.payload
        bad = [k for k, v in body.metrics.items() if not math.isfinite(v)]
        if bad:
            raise Refused(422, f"metric {bad[0]!r} is not finite")
        data = {k: v for k, v in body.metrics.items() if k not in NODE_IDLE_METRICS}
        now = self.clock()

        def record(tx: Tx) -> None:
            add_to_counter(tx, METRICS_REPORTS)  # its row lock: reports take turns, so no delta counts twice
            totals = registry.time_totals(tx)
            prev = last_node_totals(tx)
            # Totals never decrease; max() only guards against float rounding.
            d_idle, d_busy = max(totals[0] - prev[0], 0.0), max(totals[1] - prev[1], 0.0)
            data["node_idle_s"] = d_idle
            if d_idle + d_busy > 0:
                data["node_idle_frac"] = d_idle / (d_idle + d_busy)
            insert_metrics(tx, body.step, body.version, data, now, node_totals=totals)

        self.store.write(record)
