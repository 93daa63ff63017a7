"""What the run looks like from outside: RunInfo, the status snapshot (dashboard, /metrics), pages of nodes and of
trainer metrics reports, and recording the trainer's reports, to which the coordinator adds the swarm's node idle
time since the previous report.

Nothing here returns an unbounded list: the snapshot holds counters, one page of nodes and the newest reports;
every node and every report is reached by paging (`nodes_page`, `metrics_page`, keyset cursors that stay valid
while rows are added)."""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable

from sqlalchemy import select

from swarmrl.coordinator import admission, registry
from swarmrl.coordinator.auth import Refused, Signed
from swarmrl.coordinator.checkpoints import current_version
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.rows import MetricsRow, NodeRow
from swarmrl.coordinator.db.schema import METRICS_REPORTS, POOL_EPOCH, kv, metrics
from swarmrl.coordinator.db.store import Store, Tx, add_to_counter, counter, insert, load
from swarmrl.coordinator.gate import admit
from swarmrl.coordinator.idempotency import remember
from swarmrl.coordinator.verification import group_counts
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.protocol.run import sign_spec

# Trainer metrics the coordinator sets itself (from the nodes' heartbeat counters) when it records a report.
NODE_IDLE_METRICS = ("node_idle_s", "node_idle_frac")
MAX_METRIC_NAMES = 256
MAX_METRIC_NAME_CHARS = 128


def recent_metrics(tx: Tx, n: int) -> list[MetricsRow]:
    """The last `n` metrics rows, oldest first."""
    rows = tx.execute(select(metrics).order_by(metrics.c.id.desc()).limit(n))
    return [load(MetricsRow, r) for r in rows][::-1]


def metrics_after(tx: Tx, after: int, limit: int) -> list[MetricsRow]:
    """Up to `limit` metrics rows with ids after `after`, oldest first."""
    rows = tx.execute(select(metrics).where(metrics.c.id > after).order_by(metrics.c.id).limit(limit))
    return [load(MetricsRow, r) for r in rows]


def node_status(n: NodeRow, cfg: admission.AdmissionConfig) -> m.NodeStatus:
    return m.NodeStatus(node_id=n.id, name=n.name, engine=n.engine, held_version=n.held_version,
                        groups_accepted=n.groups_accepted, groups_rejected=n.groups_rejected, banned=n.banned,
                        last_seen=n.last_seen, checks_passed=n.checks_passed, reputation=n.reputation, idle_s=n.idle_s,
                        busy_s=n.busy_s, prompts_leased=n.prompts_leased, prompts_abandoned=n.prompts_abandoned,
                        lease_allowance=admission.allowance(n, cfg), gone_since=n.gone_since)


def metric_name_problem(names: list[str]) -> str | None:
    """Why these trainer metric names cannot be stored, or None. Names are label values in /metrics, so any
    printable text is fine; the bounds keep one report small."""
    if len(names) > MAX_METRIC_NAMES:
        return f"{len(names)} metrics in one report, at most {MAX_METRIC_NAMES}"
    for name in names:
        if not name or len(name) > MAX_METRIC_NAME_CHARS or not name.isprintable():
            return f"metric name {name[:40]!r}: 1 to {MAX_METRIC_NAME_CHARS} printable characters"
    return None


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


def store_epoch(store: Store) -> int:
    """The store's epoch: drawn (63 random bits) and kept the first time any process asks, the same for every
    process of the store ever after. Part of the pool's name (`protocol.signing.pool_id`): a fresh store under the
    same key and run id is another pool, and refuses what was signed for the old one."""

    def ensure(tx: Tx) -> int:
        tx.execute(insert(tx, kv).values(key=POOL_EPOCH, value=secrets.randbits(63) or 1).on_conflict_do_nothing())
        return counter(tx, POOL_EPOCH)

    return store.write(ensure)


class Status:
    """RunInfo, the status snapshot, and trainer metrics reports."""

    def __init__(self, store: Store, config: CoordinatorConfig, identity: Identity, clock: Callable[[], float],
                 epoch: int = 0):
        self.store, self.config, self.identity, self.clock, self.epoch = store, config, identity, clock, epoch
        # Bootstrap multiaddrs of the checkpoint swarm's DHT, sent to nodes in RunInfo (the seed adds its own).
        self.dht_peers: list[str] = list(config.dht_peers)
        self.spec_signature = sign_spec(config.run, identity, epoch)  # once: the run description never changes

    def run_info(self) -> m.RunInfo:
        return self.store.read(self.run_info_in)

    def run_info_in(self, tx: Tx) -> m.RunInfo:
        """RunInfo as `tx` sees the current version."""
        return self._info(current_version(tx))

    def _info(self, version: int) -> m.RunInfo:
        return m.RunInfo(spec=self.config.run, coordinator_key=self.identity.public_key_hex,
                         spec_signature=self.spec_signature, current_version=version, dht_peers=list(self.dht_peers),
                         epoch=self.epoch)

    def snapshot(self, nodes_limit: int = 100, metrics_limit: int = 100) -> m.RunStatus:
        """Counters, the first `nodes_limit` nodes and the newest `metrics_limit` trainer reports."""
        def read(tx: Tx) -> m.RunStatus:
            counts = group_counts(tx)
            nodes = registry.node_counts(tx, gone_before=self.clock() - self.config.node_gone_after_s)
            page = registry.list_nodes(tx, limit=nodes_limit)
            reports = [m.TrainerMetrics(step=r.step, version=r.version, metrics=r.data)
                       for r in recent_metrics(tx, metrics_limit)]
            adm = self.config.admission
            return m.RunStatus(run=self._info(current_version(tx)), nodes=[node_status(n, adm) for n in page],
                               groups_pending=counts["pending"] - counts["held"], groups_accepted=counts["accepted"],
                               groups_rejected=counts["rejected"], metrics=reports, groups_held=counts["held"],
                               nodes_total=nodes["total"], nodes_live=nodes["live"], nodes_gone=nodes["gone"],
                               nodes_banned=nodes["banned"],
                               nodes_next_after=page[-1].id if len(page) < nodes["total"] and page else None)

        return self.store.read(read)

    def nodes_page(self, after: str, limit: int) -> m.NodePage:
        """Up to `limit` nodes with ids after `after`, in id order."""
        rows = self.store.read(lambda tx: registry.list_nodes(tx, after=after, limit=limit + 1))
        more = len(rows) > limit
        rows = rows[:limit]
        return m.NodePage(nodes=[node_status(n, self.config.admission) for n in rows],
                          next_after=rows[-1].id if more else None)

    def metrics_page(self, after: int, limit: int) -> m.MetricsPage:
        """Up to `limit` trainer reports recorded after report `after`, oldest first."""
        rows = self.store.read(lambda tx: metrics_after(tx, after, limit + 1))
        more = len(rows) > limit
        rows = rows[:limit]
        return m.MetricsPage(reports=[m.MetricsReport(id=r.id, step=r.step, version=r.version, metrics=r.data, ts=r.ts)
                                      for r in rows], next_after=rows[-1].id if more else None)

    def record_metrics(self, req: Signed) -> None:
        body: m.TrainerMetrics = req.payload
        problem = metric_name_problem(list(body.metrics))
        if problem is not None:
            raise Refused(RefusalCode.INVALID_METRICS, problem)
        bad = [k for k, v in body.metrics.items() if not math.isfinite(v)]
        if bad:
            raise Refused(RefusalCode.INVALID_METRICS, f"metric {bad[0]!r} is not finite")
        data = {k: v for k, v in body.metrics.items() if k not in NODE_IDLE_METRICS}
        now = self.clock()

        def record(tx: Tx) -> None:
            admit(tx, req)
            add_to_counter(tx, METRICS_REPORTS)  # its row lock: reports take turns, so no delta counts twice
            totals = registry.time_totals(tx)
            prev = last_node_totals(tx)
            # Totals never decrease; max() only guards against float rounding.
            d_idle, d_busy = max(totals[0] - prev[0], 0.0), max(totals[1] - prev[1], 0.0)
            row = dict(data, node_idle_s=d_idle)
            if d_idle + d_busy > 0:
                row["node_idle_frac"] = d_idle / (d_idle + d_busy)
            insert_metrics(tx, body.step, body.version, row, now, node_totals=totals)
            remember(tx, req, None, now)

        self.store.write(record)
