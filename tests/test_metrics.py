"""Prometheus metrics of every role, through prometheus_client and read back with its exposition parser: the
coordinator's /metrics after some activity (groups, node states, checkpoint spread, rejection reasons, the ledger,
per-node counters, the trainer's last report, request counts by route template), and the trainer's, verifier's and
node's exporters served on a port of their own. Every name starts with `swarmrl_<role>_`. (The roles' processes
serving them on `metrics_port` in a running pool: test_pool_ledger.py.)"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarmrl.node.metrics import node_families
from swarmrl.node.stats import NodeStats
from swarmrl.protocol import messages as m
from swarmrl.runtime.metrics import MetricsServer, metric_name, registry_of, serve_metrics
from swarmrl.runtime.retry import Outage
from swarmrl.trainer.exporter import TrainerExporter
from swarmrl.transfer.download import FetchStats
from swarmrl.verifier.metrics import VerifierStats, serve_verifier_metrics, verifier_families
from tests.support.coordinator import GROUP, Run, busy_pool, submission


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed by prometheus_client."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def names(text: str) -> list[str]:
    return [f.name for f in text_string_to_metric_families(text)]


def test_coordinator_metrics_say_what_the_store_says(run_factory) -> None:
    run = busy_pool(run_factory)
    httpx.get(run.url + "/v1/manifest/0")
    httpx.get(run.url + "/v1/manifest/99")
    httpx.get(run.url + "/no/such/path")
    text = httpx.get(run.url + "/metrics").text
    assert all(n.startswith("swarmrl_coordinator_") for n in names(text)), names(text)
    got = samples(text)
    want = {
        ("swarmrl_coordinator_current_version", ()): 1,
        ("swarmrl_coordinator_groups", (("status", "accepted"),)): 5,
        ("swarmrl_coordinator_groups", (("status", "rejected"),)): 2,
        ("swarmrl_coordinator_groups", (("status", "pending"),)): 0,
        ("swarmrl_coordinator_nodes", (("state", "live"),)): 2,
        ("swarmrl_coordinator_nodes", (("state", "gone"),)): 1,
        ("swarmrl_coordinator_nodes", (("state", "banned"),)): 1,
        ("swarmrl_coordinator_nodes_behind", (("behind", "0"),)): 1,  # alpha holds v1
        ("swarmrl_coordinator_nodes_behind", (("behind", "1"),)): 1,  # bravo holds v0
        ("swarmrl_coordinator_rejected_groups", (("reason", "rollout #: tokens after a stop token"),)): 1,
        ("swarmrl_coordinator_rejected_groups", (("reason", "node banned"),)): 1,
        ("swarmrl_coordinator_ledger_groups_total", ()): 5,
        ("swarmrl_coordinator_ledger_tokens_total", ()): 5 * GROUP * 2,
        ("swarmrl_coordinator_receipts_total", ()): 5,
        ("swarmrl_coordinator_trainer_step", ()): 3,
        ("swarmrl_coordinator_trainer_metric", (("metric", "reward_mean"),)): 0.5,
    }
    assert {k: got.get(k) for k in want} == want
    # Bounded whatever the pool's size: no series is labelled by node (per-node figures are in /v1/nodes).
    assert not any(label in ("node", "name") for _, labels in got for label, _ in labels), sorted(got)
    nodes = list(run.op.nodes())
    assert got[("swarmrl_coordinator_nodes_busy_seconds", ())] == pytest.approx(sum(n.busy_s for n in nodes))
    # Requests by route template, never by raw path (bounded label values); unmatched paths in one bucket.
    routes = {(dict(k[1])["route"], dict(k[1])["status"]): v for k, v in got.items()
              if k[0] == "swarmrl_coordinator_http_requests_total" and dict(k[1])["method"] == "GET"}
    assert routes[("/v1/manifest/{version}", "200")] == 1 and routes[("/v1/manifest/{version}", "404")] == 1
    assert routes[("unmatched", "404")] == 1
    assert not any("/v1/manifest/0" in str(k) for k in got)
    assert got[("swarmrl_coordinator_http_request_seconds_count", (("method", "POST"), ("route", "/v1/submit")))] == 3


def test_the_exporters_helpers() -> None:
    assert metric_name("node", "leases") == "swarmrl_node_leases"
    for role, name in (("nodes", "x"), ("node", "Leases"), ("node", "a-b"), ("node", "")):
        with pytest.raises(ValueError):
            metric_name(role, name)
    registry = registry_of(lambda: [])
    assert serve_metrics(registry, "127.0.0.1", None) is None and serve_metrics(registry, "127.0.0.1", 0) is None
    server = MetricsServer(registry, "127.0.0.1", 0)
    try:
        assert httpx.get(f"http://127.0.0.1:{server.port}/metrics").status_code == 200
    finally:
        server.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{server.port}/metrics")


def scrape(registry: Any) -> str:
    server = MetricsServer(registry, "127.0.0.1", 0)
    try:
        return httpx.get(f"http://127.0.0.1:{server.port}/metrics").text
    finally:
        server.close()


def test_trainer_metrics_follow_its_reports() -> None:
    ex = TrainerExporter()
    ex.observe(0, 0, {"eval_accuracy": 0.25})
    ex.observe(1, 1, {"reward_mean": 0.4, "groups_used": 32, "groups_stale": 2, "groups_filtered": 5,
                      "trainer_idle_s": 1.5, "step_s": 0.75, "published_version": 0, "eval/accuracy": 0.3})
    ex.observe(2, 2, {"reward_mean": 0.5, "groups_used": 32, "trainer_idle_s": 0.5, "step_s": 1.25,
                      "published_version": 1})
    text = scrape(ex.registry)
    assert all(n.startswith("swarmrl_trainer_") for n in names(text))
    got = samples(text)
    want = {("swarmrl_trainer_step", ()): 2, ("swarmrl_trainer_version", ()): 2,
            ("swarmrl_trainer_published_version", ()): 1,
            ("swarmrl_trainer_groups_total", (("kind", "used"),)): 64,
            ("swarmrl_trainer_groups_total", (("kind", "stale"),)): 2,
            ("swarmrl_trainer_groups_total", (("kind", "filtered"),)): 5,
            ("swarmrl_trainer_idle_seconds_total", ()): 2.0,
            ("swarmrl_trainer_step_seconds_count", ()): 2, ("swarmrl_trainer_step_seconds_sum", ()): 2.0,
            ("swarmrl_trainer_metric", (("metric", "reward_mean"),)): 0.5,
            ("swarmrl_trainer_metric", (("metric", "eval/accuracy"),)): 0.3,  # a key that is no valid name: a label
            ("swarmrl_trainer_metric", (("metric", "eval_accuracy"),)): 0.25}
    assert {k: got.get(k) for k in want} == want


def test_verifier_and_node_metrics_read_their_counters() -> None:
    stats = VerifierStats(groups=10, full_checks=7, held=2, rejected=1, tokens_checked=700, check_seconds=3.5, bans=1)
    server = serve_verifier_metrics(stats, "127.0.0.1", None)
    assert server is None
    text = scrape(registry_of(lambda: verifier_families(stats)))
    got = samples(text)
    assert [got[("swarmrl_verifier_groups_total", (("verdict", v),))] for v in ("accepted", "held", "rejected")] == [
        7, 2, 1]
    assert got[("swarmrl_verifier_bans_total", ())] == 1 and got[("swarmrl_verifier_tokens_checked_total", ())] == 700
    stats.groups += 5  # read at every scrape: no copy is kept
    again = samples(scrape(registry_of(lambda: verifier_families(stats))))
    assert again[("swarmrl_verifier_groups_total", (("verdict", "accepted"),))] == 12

    s = NodeStats(leases=3, groups_submitted=6, groups_accepted=5, groups_rejected=1, tokens=120, accepted_tokens=100,
                  gen_seconds=4.0, receipts=4, receipt_tokens=80, held_version=2, current_version=3)
    outage = Outage("http://x")
    outage.failed("ConnectError")
    fetch = FetchStats(shards_fetched=9, bytes_fetched=9000)
    text = scrape(registry_of(lambda: node_families("ab" * 20, "volunteer", s, outage, fetch)))
    assert all(n.startswith("swarmrl_node_") for n in names(text))
    got = samples(text)
    want = {("swarmrl_node_leases_total", ()): 3, ("swarmrl_node_groups_total", (("outcome", "taken"),)): 5,
            ("swarmrl_node_groups_total", (("outcome", "refused"),)): 1, ("swarmrl_node_receipts_total", ()): 4,
            ("swarmrl_node_receipt_tokens_total", ()): 80, ("swarmrl_node_held_version", ()): 2,
            ("swarmrl_node_coordinator_up", ()): 0, ("swarmrl_node_coordinator_outages_total", ()): 1,
            ("swarmrl_node_tokens_per_second", ()): 30, ("swarmrl_node_shards_fetched_total", ()): 9,
            ("swarmrl_node_info", (("name", "volunteer"), ("node", "ab" * 20))): 1}
    assert {k: got.get(k) for k in want} == want


def test_a_status_refusal_is_counted_with_its_status(run: Run) -> None:
    node = run.node("n")
    lease = node.lease(1, 0)
    node.submit(submission(lease))
    with pytest.raises(Exception):  # noqa: B017 (any refusal: the count is what is checked)
        node.submit(m.RolloutSubmission(lease_id="nope", policy_version=0, groups=submission(lease).groups))
    got = samples(httpx.get(run.url + "/metrics").text)
    assert got[("swarmrl_coordinator_http_requests_total", (("method", "POST"), ("route", "/v1/submit"),
                                                            ("status", "404")))] == 1
