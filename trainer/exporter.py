"""The trainer's Prometheus metrics (`swarmrl_trainer_*`), served on `metrics_port` by rank 0 while it trains.

Every metrics report the trainer posts to the coordinator also goes through `TrainerExporter.observe`: the step,
version and published version as gauges, groups used, stale and filtered and the seconds spent waiting for groups
as counters, step times as a histogram, and every reported value as `swarmrl_trainer_metric{metric="<key>"}` (a
label, not a name, so that no two keys can collide)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from swarmrl.runtime.metrics import MetricsServer, metric_name, serve_metrics

ROLE = "trainer"
_STEP_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_GROUP_KINDS = {"groups_used": "used", "groups_stale": "stale", "groups_filtered": "filtered"}


class TrainerExporter:
    """The trainer's metrics in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.step = Gauge(metric_name(ROLE, "step"), "Optimizer steps taken (across restarts).", registry=r)
        self.version = Gauge(metric_name(ROLE, "version"), "The trainer's policy version.", registry=r)
        self.published = Gauge(metric_name(ROLE, "published_version"), "Newest version published to the "
                               "coordinator (-1: none yet).", registry=r)
        self.published.set(-1)
        self.groups = Counter(metric_name(ROLE, "groups"), "Groups taken from the feed: used in a step, dropped as "
                              "stale, skipped for zero advantage.", ("kind",), registry=r)
        self.idle = Counter(metric_name(ROLE, "idle_seconds"), "Seconds spent waiting for groups.", registry=r)
        self.step_seconds = Histogram(metric_name(ROLE, "step_seconds"), "Time of one optimizer step.",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.metric = Gauge(metric_name(ROLE, "metric"), "The last reported value of each trainer metric.",
                            ("metric",), registry=r)

    def observe(self, step: int, version: int, metrics: Mapping[str, float]) -> None:
        """Take one report (what is posted to the coordinator for `step`)."""
        self.step.set(step)
        self.version.set(version)
        if "published_version" in metrics:
            self.published.set(metrics["published_version"])
        for key, kind in _GROUP_KINDS.items():
            if key in metrics:
                self.groups.labels(kind).inc(max(metrics[key], 0.0))
        if "trainer_idle_s" in metrics:
            self.idle.inc(max(metrics["trainer_idle_s"], 0.0))
        if "step_s" in metrics:
            self.step_seconds.observe(metrics["step_s"])
        for key, value in metrics.items():
            self.metric.labels(key).set(value)

    def serve(self, host: str, port: int | None) -> MetricsServer | None:
        return serve_metrics(self.registry, host, port)
