"""Prometheus metrics for every role, through prometheus_client (no hand-written exposition).

Each role keeps its own `CollectorRegistry` and names its metrics `swarmrl_<role>_...` (`metric_name`), so that the
coordinator's, trainer's, verifier's and nodes' metrics never collide in one Prometheus. A role whose state already
lives in counters of its own (a stats dataclass, the coordinator's store) exposes it through a `FamilyCollector`,
which builds fresh metric families from that state at every scrape; nothing is counted twice.

    registry = CollectorRegistry()
    registry.register(FamilyCollector(lambda: [counter("node", "leases", "Leases taken.", stats.leases)]))
    server = serve_metrics(registry, "127.0.0.1", cfg.metrics_port)      # GET http://127.0.0.1:PORT/metrics
    server.close()
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from swarmrl.runtime.errors import UserError, port_problem

ROLES = ("coordinator", "trainer", "verifier", "node")
_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


def metric_name(role: str, name: str) -> str:
    """`swarmrl_<role>_<name>`; a role or name that is not a plain lower-case identifier is a bug (ValueError)."""
    if role not in ROLES or not _NAME.match(name):
        raise ValueError(f"bad metric name {role!r}/{name!r}")
    return f"swarmrl_{role}_{name}"


def counter(role: str, name: str, help_: str, value: float | None = None, labels: Sequence[str] = (),
            samples: Iterable[tuple[Sequence[str], float]] = ()) -> CounterMetricFamily:
    """A counter family: one `value`, or `samples` of (label values, value) for `labels`. Name without `_total`."""
    fam = CounterMetricFamily(metric_name(role, name), help_, value=value, labels=labels or None)
    for values, v in samples:
        fam.add_metric(list(values), v)
    return fam


def gauge(role: str, name: str, help_: str, value: float | None = None, labels: Sequence[str] = (),
          samples: Iterable[tuple[Sequence[str], float]] = ()) -> GaugeMetricFamily:
    """A gauge family: one `value`, or `samples` of (label values, value) for `labels`."""
    fam = GaugeMetricFamily(metric_name(role, name), help_, value=value, labels=labels or None)
    for values, v in samples:
        fam.add_metric(list(values), v)
    return fam


class FamilyCollector(Collector):
    """Calls `families()` at every scrape and exposes what it returns."""

    def __init__(self, families: Callable[[], Iterable[Metric]]):
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return list(self._families())

    def describe(self) -> Iterable[Metric]:
        return []  # built at scrape time: nothing to check for duplicates at registration


def registry_of(*families: Callable[[], Iterable[Metric]]) -> CollectorRegistry:
    """A fresh registry (never the process-wide default) exposing each of `families` through a FamilyCollector."""
    registry = CollectorRegistry(auto_describe=False)
    for fn in families:
        registry.register(FamilyCollector(fn))
    return registry


class MetricsServer:
    """prometheus_client's HTTP exporter for one registry, in a daemon thread; `port` is the port it listens on."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        self._httpd: WSGIServer
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:  # a port in use, a host that is not this machine's: the user's to fix
            raise UserError(port_problem("metrics_port", "metrics_host", host, port, e)) from None
        self.port: int = self._httpd.server_port

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)


def serve_metrics(registry: CollectorRegistry, host: str, port: int | None) -> MetricsServer | None:
    """Serve `registry` on host:port (a role's `metrics_port`); None (nothing served) when the port is 0 or None."""
    return MetricsServer(registry, host, port) if port else None
