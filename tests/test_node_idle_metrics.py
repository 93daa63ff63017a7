"""Node idle time reaches the operator: heartbeat counters in status, /metrics and the dashboard, and the
swarm's idle share per trainer step. Real uvicorn on loopback, real Ed25519, real SQLite (the API tests'
fixtures); the coordinator's clock is advanced by hand, so nothing here waits on timing."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from swarmrl.coordinator import registry, status
from swarmrl.coordinator.db.store import Store
from swarmrl.coordinator.registry import COUNTER_SLACK_FRAC, COUNTER_SLACK_S
from swarmrl.node.agent import Node
from swarmrl.node.config import NodeConfig
from swarmrl.protocol import messages as m
from swarmrl.testing.byzantine.harness import make_checkpoint
from swarmrl.testing.waiting import wait_for
from tests.support.coordinator import Run, post, signed


@pytest.fixture
def run(run_factory) -> Run:
    """A coordinator with version 0 published, whose clock the tests move by minutes: signed requests keep
    the real time, so the accepted clock skew is widened to an hour."""
    r = run_factory(clock_skew_s=3600.0)
    r.publish(0)
    return r


def _node_row(run: Run, node_id: str) -> m.NodeStatus:
    return next(n for n in run.op.status().nodes if n.node_id == node_id)


def _step_metrics(run: Run, step: int) -> dict[str, float]:
    return next(x.metrics for x in run.op.status().metrics if x.step == step)


def test_heartbeat_counters_in_status_metrics_and_dashboard(run: Run) -> None:
    node = run.node("alpha")
    run.clock.advance(60)
    node.heartbeat(0, status="generating", idle_s=12.5, busy_s=30.25)
    row = _node_row(run, node.identity.node_id)
    assert (row.idle_s, row.busy_s, row.held_version) == (12.5, 30.25, 0)

    run.clock.advance(60)
    node.heartbeat(0, idle_s=20.0, busy_s=70.0)  # the latest report replaces the previous one
    row = _node_row(run, node.identity.node_id)
    assert (row.idle_s, row.busy_s) == (20.0, 70.0)

    # /metrics: the nodes' seconds summed, with no label per node (its size does not grow with the pool); the
    # node's own figures are in /v1/nodes.
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(run.url + "/metrics").text)}
    for name, value in (("idle", 20.0), ("busy", 70.0)):
        samples = families[f"swarmrl_coordinator_nodes_{name}_seconds"].samples
        assert [(s.name, s.labels, s.value) for s in samples] == [(f"swarmrl_coordinator_nodes_{name}_seconds", {},
                                                                   value)]
    [mine] = [n for n in run.op.nodes() if n.node_id == node.identity.node_id]
    assert (mine.idle_s, mine.busy_s) == (20.0, 70.0)

    page = httpx.get(run.url + "/").text
    assert "n.idle_s" in page and "n.busy_s" in page and "node_idle_frac" in page


def test_node_idle_frac_across_two_steps(run: Run) -> None:
    a, b = run.node("a"), run.node("b")
    run.clock.advance(100)
    a.heartbeat(0, idle_s=10.0, busy_s=30.0)
    b.heartbeat(0, idle_s=20.0, busy_s=40.0)
    run.op.metrics(step=1, version=0, metrics={"reward_mean": 0.5, "trainer_idle_s": 1.5})
    first = _step_metrics(run, 1)
    assert first["node_idle_s"] == pytest.approx(30.0)
    assert first["node_idle_frac"] == pytest.approx(30.0 / 100.0)
    assert first["reward_mean"] == 0.5 and first["trainer_idle_s"] == 1.5  # the trainer's own metrics are kept

    run.clock.advance(100)
    a.heartbeat(0, idle_s=15.0, busy_s=60.0)  # +5 idle, +30 busy
    b.heartbeat(0, idle_s=20.0, busy_s=40.0)  # unchanged
    run.op.metrics(step=2, version=1, metrics={"reward_mean": 0.6})
    second = _step_metrics(run, 2)
    assert second["node_idle_s"] == pytest.approx(5.0)
    assert second["node_idle_frac"] == pytest.approx(5.0 / 35.0)
    assert _step_metrics(run, 1) == first  # earlier rows are not rewritten

    samples = [s for f in text_string_to_metric_families(httpx.get(run.url + "/metrics").text) for s in f.samples]
    assert [s.value for s in samples if s.name == "swarmrl_coordinator_trainer_metric"
            and s.labels == {"metric": "node_idle_frac"}] == [pytest.approx(5.0 / 35.0)]

    # No node time since step 2: node_idle_s is 0 and the fraction is left out, even if the trainer sent one.
    run.op.metrics(step=3, version=2, metrics={"reward_mean": 0.7, "node_idle_frac": 0.99, "node_idle_s": 9.0})
    third = _step_metrics(run, 3)
    assert third["node_idle_s"] == 0.0 and "node_idle_frac" not in third


def test_node_restart_counts_new_values(run: Run) -> None:
    node = run.node("phoenix")
    run.clock.advance(200)
    node.heartbeat(0, idle_s=50.0, busy_s=50.0)
    run.op.metrics(step=1, version=0, metrics={})
    assert _step_metrics(run, 1)["node_idle_frac"] == pytest.approx(0.5)

    # The node process restarts (same key, registers again): its counters begin again from 0. Idle went down,
    # so both new values are the deltas, even busy_s, which happens to be above its old value.
    run.clock.advance(100)
    node.register(name="phoenix")
    node.heartbeat(0, idle_s=5.0, busy_s=70.0)
    run.op.metrics(step=2, version=0, metrics={})
    second = _step_metrics(run, 2)
    assert second["node_idle_s"] == pytest.approx(5.0)
    assert second["node_idle_frac"] == pytest.approx(5.0 / 75.0)
    row = _node_row(run, node.identity.node_id)
    assert (row.idle_s, row.busy_s) == (5.0, 70.0)  # status shows what the node reported last

    run.clock.advance(100)
    node.heartbeat(0, idle_s=25.0, busy_s=70.0)  # counting on from the restart
    run.op.metrics(step=3, version=0, metrics={})
    third = _step_metrics(run, 3)
    assert third["node_idle_s"] == pytest.approx(20.0) and third["node_idle_frac"] == pytest.approx(1.0)


def test_out_of_range_counters_refused(run: Run) -> None:
    node = run.node()
    run.clock.advance(100)
    node.heartbeat(3, idle_s=1.0, busy_s=2.0)
    for bad in ({"idle_s": -1.0}, {"busy_s": -0.5}, {"idle_s": 2e9}, {"busy_s": 1e9 + 1}, {"idle_s": "lots"}):
        req = signed(node.identity, m.KIND_HEARTBEAT, run.pool, {"held_version": 9, **bad}, ts=run.clock())
        status, detail = post(run.url, "/v1/heartbeat", req)
        assert status == 422, (bad, status, detail)
        assert next(iter(bad)) in detail, detail
    row = _node_row(run, node.identity.node_id)
    assert (row.held_version, row.idle_s, row.busy_s) == (3, 1.0, 2.0)  # a refused heartbeat changed nothing
    for value in (float("nan"), float("inf"), -1.0, 1e10):
        with pytest.raises(ValidationError):
            m.Heartbeat(idle_s=value)
    # The largest allowed values pass.
    run.clock.advance(100)
    node.heartbeat(3, idle_s=m.MAX_NODE_SECONDS, busy_s=m.MAX_NODE_SECONDS)
    assert _node_row(run, node.identity.node_id).idle_s == m.MAX_NODE_SECONDS


def test_counters_beyond_wall_time_are_scaled_down(run: Run) -> None:
    """A node cannot report more idle + busy time than passed since its previous heartbeat (plus slack)."""
    liar, honest = run.node("liar"), run.node("honest")
    run.clock.advance(100)
    liar.heartbeat(0, idle_s=1e9, busy_s=0.0)
    honest.heartbeat(0, idle_s=0.0, busy_s=90.0)
    run.op.metrics(step=1, version=0, metrics={})
    first = _step_metrics(run, 1)
    cap = 100 * (1 + COUNTER_SLACK_FRAC) + COUNTER_SLACK_S
    assert cap <= first["node_idle_s"] <= cap + 1.0  # + the real seconds this test took
    assert first["node_idle_frac"] == pytest.approx(first["node_idle_s"] / (first["node_idle_s"] + 90.0))
    assert _node_row(run, liar.identity.node_id).idle_s == 1e9  # stored as reported, for the operator to see


def test_node_agent_reports_busy_and_idle(run_factory, tmp_path: Path) -> None:
    """The real node loop sends its counters: a real tiny checkpoint, fetched and generated from with the torch
    engine. Before the first checkpoint the node has no work and waits (idle)."""
    run = run_factory()
    cfg = NodeConfig(coordinator_url=run.url, key_path=tmp_path / "node.key", work_dir=tmp_path / "node-data",
                     name="agent", poll_interval_s=0.05, progress=False, max_leases=2, max_prompts=1,
                     heartbeat_interval_s=0.01, engine={"kind": "torch", "proofs": False})
    node = Node(cfg)
    runner = threading.Thread(target=node.run, daemon=True)
    runner.start()
    wait_for(lambda: node.stats.registrations > 0 and node.stats.idle_seconds > 0, what="the node waiting for work")
    run.publish_checkpoint(make_checkpoint(tmp_path / "ckpt"), 0, shard_size=60_000)
    runner.join(timeout=300)
    assert not runner.is_alive(), "the node did not finish its two leases"
    stats = node.stats
    assert stats.leases == 2 and stats.groups_submitted == 2 and stats.held_version == 0
    assert stats.busy_seconds > 0 and stats.idle_seconds > 0
    row = _node_row(run, node.identity.node_id)
    # A heartbeat goes out after every loop turn here; the last one after the second lease was submitted.
    assert row.name == "agent" and row.held_version == 0
    assert row.idle_s == pytest.approx(stats.idle_seconds) and row.busy_s == pytest.approx(stats.busy_seconds)


def test_counter_columns_added_to_an_existing_database(tmp_path: Path) -> None:
    """A database made before the counters existed gets the columns, keeping its rows."""
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE nodes (id TEXT PRIMARY KEY, public_key TEXT NOT NULL UNIQUE, name TEXT NOT NULL DEFAULT '',
            engine TEXT NOT NULL DEFAULT '', registered_at DOUBLE PRECISION NOT NULL,
            last_seen DOUBLE PRECISION NOT NULL, held_version BIGINT NOT NULL DEFAULT -1,
            banned INTEGER NOT NULL DEFAULT 0, ban_reason TEXT NOT NULL DEFAULT '',
            groups_accepted BIGINT NOT NULL DEFAULT 0, groups_rejected BIGINT NOT NULL DEFAULT 0,
            reputation DOUBLE PRECISION NOT NULL DEFAULT 0.5, checks_passed BIGINT NOT NULL DEFAULT 0);
        CREATE TABLE metrics (id INTEGER PRIMARY KEY AUTOINCREMENT, step BIGINT NOT NULL, version BIGINT NOT NULL,
            data TEXT NOT NULL, ts DOUBLE PRECISION NOT NULL);
        INSERT INTO nodes (id, public_key, name, registered_at, last_seen, groups_accepted)
            VALUES ('n1', 'k1', 'old', 1.0, 2.0, 7);
        INSERT INTO metrics (step, version, data, ts) VALUES (4, 1, '{"reward": 0.5}', 3.0);
    """)
    db.commit()
    db.close()

    store = Store(f"sqlite:///{path}")
    try:
        node = store.read(lambda tx: registry.get_node(tx, "n1"))
        assert node is not None and node.groups_accepted == 7 and node.name == "old"
        assert (node.idle_s, node.busy_s, node.idle_total, node.busy_total) == (0, 0, 0, 0)
        assert node.counters_at is None
        assert store.read(lambda tx: status.recent_metrics(tx, 10))[0].data == {"reward": 0.5}
        assert store.read(status.last_node_totals) == (0.0, 0.0)
        store.write(lambda tx: registry.note_beat(tx, "n1", 10.0, 0, 4.0, 6.0, 4.0, 6.0))
        assert store.read(registry.time_totals) == (4.0, 6.0)
        store.write(lambda tx: status.insert_metrics(tx, 5, 2, {"reward": 0.6}, now=11.0, node_totals=(4.0, 6.0)))
        assert store.read(status.last_node_totals) == (4.0, 6.0)
    finally:
        store.close()
    Store(f"sqlite:///{path}").close()  # opening a migrated database again is a no-op
