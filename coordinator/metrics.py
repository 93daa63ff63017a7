"""The coordinator's Prometheus metrics (GET /metrics), through prometheus_client.

Every name starts with `swarmrl_coordinator_` (`runtime.metrics.metric_name`). What the store knows (groups by
outcome, nodes by state, checkpoint spread, rejection reasons, the ledger, the nodes' counters summed, the
watchdog's word, the trainer's last report) is read at scrape time; request counts and latencies are counted as requests
pass (`HttpMetrics`). Trainer metric keys become label values (`metric="eval/accuracy"`), never names, so no two
keys can collide however they are spelled.

Every label set is bounded whatever the pool's size: nothing here is labelled by node (a series set per node ever
seen grew to megabytes at 10,000 identities, and each scrape read every node row). Per-node figures are in
GET /v1/nodes and on the dashboard.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric
from sqlalchemy import func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from swarmrl.coordinator.db.schema import nodes
from swarmrl.coordinator.status import recent_metrics
from swarmrl.protocol.overview import Blocker
from swarmrl.runtime.metrics import counter, gauge, metric_name, registry_of

if TYPE_CHECKING:
    from swarmrl.coordinator.service import Coordinator

_NODE_SUMS = select(func.coalesce(func.sum(nodes.c.idle_s), 0.0), func.coalesce(func.sum(nodes.c.busy_s), 0.0))
CONTENT_TYPE = CONTENT_TYPE_LATEST
ROLE = "coordinator"
_METHODS = frozenset({"GET", "POST", "PUT", "HEAD", "DELETE", "PATCH", "OPTIONS"})
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def behind_label(current: int, held: int) -> str:
    """How far a held version is behind the current one, as a bounded label value."""
    if held < 0:
        return "none"
    behind = current - held
    return "ahead" if behind < 0 else str(behind) if behind < 3 else "3_or_more"


def store_families(svc: Coordinator) -> list[Metric]:
    """The metric families of what the coordinator's store says now."""
    ov = svc.overviews.overview()
    run = svc.config.run.run_id

    def read(tx):  # noqa: ANN001, ANN202 (a read transaction)
        last = recent_metrics(tx, 1)
        return tx.execute(_NODE_SUMS).one(), (last[0] if last else None)

    (idle_s, busy_s), last = svc.store.read(read)
    behind: dict[str, float] = {}
    for s in ov.spread:
        key = behind_label(ov.current_version, s.version)
        behind[key] = behind.get(key, 0) + s.nodes
    fams: list[Metric] = [
        gauge(ROLE, "info", "The run this coordinator serves and its key (value 1).", labels=("run", "key"),
              samples=[((run, svc.identity.public_key_hex), 1.0)]),
        gauge(ROLE, "current_version", "Newest published policy version (-1 before the first).", ov.current_version),
        gauge(ROLE, "groups", "Submitted rollout groups by outcome (held: accepted by the cheap checks, waiting for a "
              "later full check of its node).", labels=("status",), samples=[((k,), v) for k, v in ov.groups.items()]),
        gauge(ROLE, "rejected_groups", "Rejected groups by kind of reason (numbers replaced by #; the 20 most frequent "
              "kinds).", labels=("reason",), samples=[((r.reason,), r.groups) for r in ov.reasons]),
        gauge(ROLE, "nodes", "Registered nodes by state: live, gone (not heard from for node_gone_after_s), banned.",
              labels=("state",), samples=[((k,), v) for k, v in ov.nodes.items()]),
        gauge(ROLE, "nodes_behind", "Live, unbanned nodes by how many versions the newest one they hold is behind the "
              "current version (their self-report).", labels=("behind",),
              samples=[((k,), v) for k, v in behind.items()]),
        counter(ROLE, "ledger_groups", "Groups accepted into the contribution ledger.", ov.ledger_groups),
        counter(ROLE, "ledger_tokens", "Completion tokens of the groups in the ledger.", ov.ledger_tokens),
        counter(ROLE, "receipts", "Receipts signed for accepted groups.", ov.receipts),
        gauge(ROLE, "nodes_idle_seconds", "Seconds the nodes waited for work or weights, summed over every node "
              "since each started (their untrusted self-reports; per node: GET /v1/nodes).", float(idle_s)),
        gauge(ROLE, "nodes_busy_seconds", "Seconds the nodes spent generating and submitting, summed likewise.",
              float(busy_s)),
    ]
    if ov.training is not None:
        t = ov.training
        fams += [
            gauge(ROLE, "training_stalled", "1 while no new policy version has come for the watchdog's stall_after_s.",
                  float(t.stalled)),
            gauge(ROLE, "seconds_since_last_version", "Seconds since the newest policy version was published.",
                  t.since_last_step_s),
            gauge(ROLE, "training_blocked", "1 for each thing that keeps the pool from training now (the watchdog's "
                  "blockers; docs/liveness.md).", labels=("blocker",),
                  samples=[((b.value,), float(b in t.blockers)) for b in Blocker]),
        ]
    if last is not None:
        fams.append(gauge(ROLE, "trainer_step", "Step of the trainer's last metrics report.", last.step))
        fams.append(gauge(ROLE, "trainer_metric", "The trainer's last reported metrics, by key.", labels=("metric",),
                          samples=[((k,), v) for k, v in sorted(last.data.items())]))
    return fams


class HttpMetrics:
    """ASGI middleware counting requests by route template (never the raw path), method and status, and timing
    them."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry):
        self.app = app
        self.requests = Counter(metric_name(ROLE, "http_requests"), "HTTP requests answered.",
                                ("route", "method", "status"), registry=registry)
        self.seconds = Histogram(metric_name(ROLE, "http_request_seconds"), "Time to answer an HTTP request.",
                                 ("route", "method"), registry=registry, buckets=_LATENCY_BUCKETS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        t0 = time.perf_counter()

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")  # set by the router once it matched one
            method = scope.get("method", "") if scope.get("method") in _METHODS else "other"
            self.requests.labels(route, method, str(status)).inc()
            self.seconds.labels(route, method).observe(time.perf_counter() - t0)


def coordinator_registry(svc: Coordinator) -> CollectorRegistry:
    """The registry /metrics renders: the store's families at scrape time (HttpMetrics adds its own)."""
    return registry_of(lambda: store_families(svc))


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
