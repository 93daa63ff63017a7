"""Liveness and paging: a node that stops talking is marked gone and its leases are freed (for its own slots and for
the backpressure buffer other nodes wait on; their prompts are leased again to others), operators see it in
/v1/status, /v1/nodes and /metrics, and its next request brings it back, its late groups answered group by group
(leased again) and counted nowhere. Every list is paged: nodes and trainer reports are
reached page by page, each exactly once. The coordinator's clock is injected; the sweep runs on its own thread
every 50 ms, and the tests wait for what it changes."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from swarmrl.coordinator.leases import SETTLED
from swarmrl.protocol import messages as m
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.testing.waiting import wait_for
from tests.support.coordinator import Run, refused, submission


def test_silent_nodes_are_marked_gone_their_leases_freed_and_they_come_back(run_factory, caplog) -> None:
    # Every identity counts as proven here: the backpressure buffer, not the newcomers' share of it, is at stake.
    run: Run = run_factory(node_gone_after_s=30.0, housekeeping_interval_s=0.05, max_outstanding_leases=1,
                           max_buffered_groups=4, admission={"proven_after_groups": 0})
    run.publish(0)
    quiet, busy = run.node("quiet"), run.node("busy", source="127.0.0.2")  # another machine: it takes the freed prompts
    lease = quiet.lease(3, 0)
    refused(lambda: quiet.lease(1, 0), 429, "open leases")  # its one slot is taken
    busy.submit(submission(busy.lease(1, 0)))
    assert busy.lease(1, 0) is None  # the buffer (4) is full, mostly of the quiet node's work: no lease

    run.clock.advance(20)
    busy.heartbeat(0)
    run.clock.advance(15)  # quiet: 35 s silent; busy: 15 s
    wait_for(lambda: any(n.gone_since is not None for n in run.op.nodes()), "the sweep to free the leases")
    st = run.op.status()
    assert (st.nodes_total, st.nodes_live, st.nodes_gone, st.nodes_banned) == (2, 1, 1, 0)
    gone = {n.node_id: n.gone_since for n in run.op.nodes()}
    assert gone[quiet.identity.node_id] is not None and gone[busy.identity.node_id] is None
    assert any("marked gone" in r.getMessage() for r in caplog.records)
    prom = {(s.name, tuple(s.labels.items())): s.value
            for f in text_string_to_metric_families(httpx.get(run.url + "/metrics").text) for s in f.samples}
    assert prom[("swarmrl_coordinator_nodes", (("state", "gone"),))] == 1
    assert prom[("swarmrl_coordinator_nodes", (("state", "live"),))] == 1

    second = busy.lease(2, 0)  # the freed lease no longer holds the buffer, and its prompts are leased again first
    assert second is not None and len(second.prompts) == 2
    assert {p.text for p in second.prompts} <= {p.text for p in lease.prompts}
    quiet_status = next(n for n in run.op.nodes() if n.node_id == quiet.identity.node_id)
    assert quiet_status.prompts_abandoned == 3

    # The quiet node comes back: its groups of the freed lease are answered one by one (leased again), nothing is
    # taken twice, and it is live again.
    for _ in range(2):
        result = quiet.submit(submission(lease))
        assert result.accepted == [] and result.rejected == {p.prompt_id: SETTLED for p in lease.prompts}
    st = run.op.status()
    assert st.nodes_gone == 0 and st.groups_pending == 1  # the busy node's one
    assert all(n.gone_since is None for n in run.op.nodes())


def test_nodes_and_reports_are_paged(run: Run) -> None:
    nodes = [run.node(f"n{i}") for i in range(7)]
    for step in range(1, 6):
        run.op.metrics(step=step, version=0, metrics={"reward_mean": step / 10})
    ids = sorted(n.identity.node_id for n in nodes)

    pages, after = [], ""
    while after is not None:
        page = m.NodePage.model_validate_json(httpx.get(run.url + "/v1/nodes", params={"after": after,
                                                                                       "limit": 3}).content)
        assert len(page.nodes) <= 3
        pages.append([n.node_id for n in page.nodes])
        after = page.next_after
    assert [len(p) for p in pages] == [3, 3, 1] and sum(pages, []) == ids
    assert [n.node_id for n in run.op.nodes(page=2)] == ids

    st = run.op.status(nodes=3, metrics=2)
    assert [n.node_id for n in st.nodes] == ids[:3] and st.nodes_next_after == ids[2] and st.nodes_total == 7
    assert [r.step for r in st.metrics] == [4, 5]  # the newest, oldest first
    assert run.op.status(nodes=10).nodes_next_after is None
    reports = list(run.op.trainer_reports(page=2))
    assert [r.step for r in reports] == [1, 2, 3, 4, 5] and [r.id for r in reports] == sorted(r.id for r in reports)
    assert [r.step for r in run.op.trainer_reports(after=reports[2].id)] == [4, 5]

    for path, params in [("/v1/nodes", {"limit": 0}), ("/v1/nodes", {"limit": m.MAX_PAGE + 1}),
                         ("/v1/status", {"nodes": -1}), ("/v1/metrics/trainer", {"after": -1}),
                         ("/v1/nodes", {"after": "x" * 65})]:
        resp = httpx.get(run.url + path, params=params)
        assert resp.status_code == 422 and resp.json()["detail"], (path, params)


def test_trainer_metric_names_are_bounded(run: Run) -> None:
    op = CoordinatorClient(run.url, run.op.identity, retries=0)
    refused(lambda: op.metrics(1, 0, {f"m{i}": 0.0 for i in range(300)}), 422, "at most")
    refused(lambda: op.metrics(1, 0, {"x" * 200: 0.0}), 422, "metric name")
    refused(lambda: op.metrics(1, 0, {"bad\nname": 0.0}), 422, "printable")
    assert list(run.op.trainer_reports()) == []
