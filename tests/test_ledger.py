"""The contribution ledger and its receipts, through the coordinator's HTTP API: a receipt is signed when (and only
when) a group is accepted, by a verdict or by a release from quarantine; nodes collect theirs with a signed GET,
page by page; the ledger adds up to the receipts; refused requests change nothing. Real uvicorn on loopback, real
Ed25519, real SQLite (and the same tests on PostgreSQL: `both_stores`)."""

from __future__ import annotations

import json

import httpx
import pytest
from sqlalchemy import text

from swarmrl.coordinator.db.store import Store
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.receipts import KIND_RECEIPTS, Receipt, ReceiptsRequest, verify_receipt
from swarmrl.protocol.signing import PAYLOAD_HEADER, SIGNATURE_HEADER, sign
from swarmrl.runtime.client import CoordinatorClient
from tests.support.coordinator import GROUP, Run, refused, submission

pytestmark = pytest.mark.both_stores  # each test on SQLite and on PostgreSQL (conftest.py)

TOKENS_PER_GROUP = GROUP * 2  # `submission` gives every rollout two completion tokens


def submit_groups(run: Run, node: CoordinatorClient, n: int) -> list[int]:
    """Lease and submit `n` groups for `node`; the coordinator's group ids, in submission order."""
    lease = node.lease(n, 0)
    node.submit(submission(lease))
    return [p.group_id for p in run.op.pending(1024) if p.node_id == node.identity.node_id]


def all_receipts(node: CoordinatorClient, limit: int = 1000) -> list[Receipt]:
    out, after = [], 0
    while page := node.receipts(after=after, limit=limit).receipts:
        out += page
        after = page[-1].seq
    return out


def test_a_receipt_per_accepted_group_and_none_for_the_others(run: Run) -> None:
    node = run.node("worker")
    g = submit_groups(run, node, 4)
    assert node.receipts().receipts == []  # submitted is not accepted
    run.op.verdicts([m.Verdict(group_id=g[0], accepted=True, rewards=[1.0] * GROUP),
                     m.Verdict(group_id=g[1], accepted=False, reason="rollout 1: tokens after a stop token"),
                     m.Verdict(group_id=g[2], accepted=True, rewards=[0.5] * GROUP, checked=False)])  # held
    page = node.receipts()
    assert [r.prompt_id for r in page.receipts] == [f"{page.receipts[0].lease_id}.0"]
    first = page.receipts[0]
    assert (first.seq, first.tokens, first.policy_version, first.run_id) == (1, TOKENS_PER_GROUP, 0, "test-run")
    assert (page.head, page.next_after) == (1, 1)
    assert verify_receipt(first, run.key.public_key_hex, node.identity.node_id) is None

    # A full check of the node's later group releases the held one first: two more receipts, in that order.
    run.op.verdicts([m.Verdict(group_id=g[3], accepted=True, rewards=[0.0] * GROUP)])
    receipts = all_receipts(node, limit=1)
    assert [r.seq for r in receipts] == [1, 2, 3]
    assert [r.prompt_id.rsplit(".", 1)[1] for r in receipts] == ["0", "2", "3"]
    assert all(verify_receipt(r, run.key.public_key_hex, node.identity.node_id) is None for r in receipts)
    assert node.receipts(after=3).receipts == [] and node.receipts(after=3).head == 3

    ledger = run.op.ledger()
    assert [(e.node_id, e.name, e.policy_version, e.groups, e.tokens) for e in ledger.entries] == [
        (node.identity.node_id, "worker", 0, 3, 3 * TOKENS_PER_GROUP)]
    assert ledger.next_after is None
    assert sum(r.tokens for r in receipts) == ledger.entries[0].tokens


def test_receipts_are_the_signers_own_and_the_request_must_be_signed(run: Run) -> None:
    a, b = run.node("a"), run.node("b")
    g = submit_groups(run, a, 2)
    run.op.verdicts([m.Verdict(group_id=i, accepted=True, rewards=[1.0] * GROUP) for i in g])
    assert len(a.receipts().receipts) == 2
    assert b.receipts().receipts == [] and b.receipts().head == 0
    stranger = CoordinatorClient(run.url, Identity.generate(), retries=0)  # never registered: nothing to collect
    assert stranger.receipts().receipts == []

    def get(headers: dict[str, str]) -> httpx.Response:
        return httpx.get(run.url + "/v1/receipts", headers=headers)

    def signed_get(payload: dict, kind: str = KIND_RECEIPTS) -> dict[str, str]:
        """A signed GET: the payload in its header, signed as the body."""
        body = json.dumps(payload).encode()
        return {PAYLOAD_HEADER: body.decode(), SIGNATURE_HEADER: sign(a.identity, kind, run.pool, body).header()}

    assert get({}).status_code == 401
    other = signed_get(ReceiptsRequest().model_dump())
    assert get({**other, PAYLOAD_HEADER: json.dumps({"after": 0, "limit": 5})}).status_code == 401  # not as signed
    good = signed_get(ReceiptsRequest().model_dump())
    assert get(signed_get(ReceiptsRequest().model_dump(), m.KIND_HEARTBEAT)).status_code == 401  # another kind
    assert get(signed_get({"after": 0, "limit": 5000})).status_code == 422
    assert get(signed_get({"after": -1})).status_code == 422
    resp = get(good)
    assert resp.status_code == 200 and len(resp.json()["receipts"]) == 2
    assert get(good).status_code == 409  # replayed


def test_a_refused_verdict_batch_signs_nothing(run: Run) -> None:
    node = run.node("n")
    g = submit_groups(run, node, 2)
    refused(lambda: run.op.verdicts([m.Verdict(group_id=g[0], accepted=True, rewards=[1.0] * GROUP),
                                     m.Verdict(group_id=g[1], accepted=True, rewards=[1.0])]), 422, "rewards")
    assert node.receipts().receipts == [] and run.op.ledger().entries == []
    assert run.op.overview().receipts == 0
    # The same verdict twice: one receipt.
    v = [m.Verdict(group_id=g[0], accepted=True, rewards=[1.0] * GROUP)]
    run.op.verdicts(v)
    run.op.verdicts(v)
    assert [r.seq for r in node.receipts().receipts] == [1]


def test_a_banned_node_keeps_what_it_earned_and_no_more(run: Run) -> None:
    node = run.node("cheat")
    g = submit_groups(run, node, 3)
    run.op.verdicts([m.Verdict(group_id=g[0], accepted=True, rewards=[1.0] * GROUP),
                     m.Verdict(group_id=g[1], accepted=True, rewards=[1.0] * GROUP, checked=False),  # held
                     m.Verdict(group_id=g[2], accepted=False, reason="logprobs forged", ban=True)])
    assert [r.prompt_id.rsplit(".", 1)[1] for r in node.receipts().receipts] == ["0"]  # the held group is dropped
    refused(lambda: node.heartbeat(0), 403, "banned")
    entries = run.op.ledger(node_id=node.identity.node_id).entries
    assert [(e.groups, e.tokens) for e in entries] == [(1, TOKENS_PER_GROUP)]


def test_ledger_pages_by_node_and_version(run: Run) -> None:
    nodes = [run.node(f"n{i}") for i in range(3)]
    for version in (0, 1):
        if version:
            run.publish(1)
        for i, node in enumerate(nodes):
            lease = node.lease(i + 1, version)
            node.submit(submission(lease))
        run.op.verdicts([m.Verdict(group_id=p.group_id, accepted=True, rewards=[1.0] * GROUP)
                         for p in run.op.pending(1024)])
    entries, after = [], 0
    while True:
        page = run.op.ledger(after=after, limit=2)
        entries += page.entries
        if page.next_after is None:
            break
        after = page.next_after
    got = sorted((e.name, e.policy_version, e.groups, e.tokens) for e in entries)
    assert got == sorted((f"n{i}", v, i + 1, (i + 1) * TOKENS_PER_GROUP) for i in range(3) for v in (0, 1))
    assert len({e.cursor for e in entries}) == 6
    mine = run.op.ledger(node_id=nodes[2].identity.node_id).entries
    assert [(e.policy_version, e.groups) for e in mine] == [(0, 3), (1, 3)]
    ov = run.op.overview()
    assert (ov.ledger_groups, ov.ledger_tokens, ov.receipts) == (12, 12 * TOKENS_PER_GROUP, 12)
    for query in ("limit=0", "limit=1001", "after=-1", "node_id=xyz", "after=abc"):
        resp = httpx.get(f"{run.url}/v1/ledger?{query}")
        assert resp.status_code == 422 and resp.json()["detail"], query
    # One row per node over both versions, most tokens first (the dashboard's table); the limit keeps the top.
    top = httpx.get(f"{run.url}/v1/ledger/nodes?limit=2").json()["nodes"]
    assert [(n["name"], n["groups"], n["tokens"], n["versions"]) for n in top] == [
        ("n2", 6, 6 * TOKENS_PER_GROUP, 2), ("n1", 4, 4 * TOKENS_PER_GROUP, 2)]
    assert httpx.get(f"{run.url}/v1/ledger/nodes?limit=0").status_code == 422


def test_groups_accepted_before_the_ledger_get_their_receipts_at_start(run_factory, tmp_path) -> None:
    data_dir = tmp_path / "old"
    op_key = Identity.generate()
    r = run_factory(data_dir=data_dir, op_key=op_key)
    r.publish(0)
    node = r.node("veteran")
    g = submit_groups(r, node, 3)
    r.op.verdicts([m.Verdict(group_id=i, accepted=True, rewards=[1.0] * GROUP) for i in g[:2]])
    url = r.cfg.resolved_store_url
    run_factory.stop_last()
    # What a database from before the ledger holds: accepted groups, no receipts, no ledger rows.
    store = Store(url)
    try:
        def forget(tx) -> None:  # noqa: ANN001
            tx.execute(text("DELETE FROM receipts"))
            tx.execute(text("DELETE FROM ledger"))
            tx.execute(text("UPDATE kv SET value = 0 WHERE key = 'receipt_seq'"))

        store.write(forget)
    finally:
        store.close()
    again = run_factory(data_dir=data_dir, op_key=op_key)
    client = CoordinatorClient(again.url, node.identity, retries=0)
    receipts = client.receipts().receipts
    assert sorted(r.prompt_id.rsplit(".", 1)[1] for r in receipts) == ["0", "1"]
    assert all(verify_receipt(x, again.key.public_key_hex, node.identity.node_id) is None for x in receipts)
    assert [(e.groups, e.tokens) for e in again.op.ledger().entries] == [(2, 2 * TOKENS_PER_GROUP)]
    run_factory.stop_last()
    third = run_factory(data_dir=data_dir, op_key=op_key)  # a restart with nothing missing signs nothing more
    assert third.op.overview().receipts == 2


def test_a_receipt_file_line_is_the_signed_json(run: Run) -> None:
    node = run.node("n")
    g = submit_groups(run, node, 1)
    run.op.verdicts([m.Verdict(group_id=g[0], accepted=True, rewards=[1.0] * GROUP)])
    receipt = node.receipts().receipts[0]
    again = Receipt.model_validate_json(receipt.model_dump_json())
    assert verify_receipt(again, run.key.public_key_hex) is None
    tampered = Receipt.model_validate({**json.loads(receipt.model_dump_json()), "tokens": receipt.tokens + 1})
    assert "bad signature" in verify_receipt(tampered, run.key.public_key_hex)
    with pytest.raises(ValueError):
        Receipt.model_validate({**json.loads(receipt.model_dump_json()), "extra": 1})
