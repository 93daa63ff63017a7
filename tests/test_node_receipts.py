"""What a node keeps and shows: the coordinator's signed receipts (checked, appended to receipts.jsonl once each,
counted again after a restart) and the live panel's contents."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pydantic import ValidationError
from rich.console import Console

from swarmrl.node.agent import Node
from swarmrl.node.config import NodeConfig
from swarmrl.node.receipts import ReceiptBook
from swarmrl.node.runner import render
from swarmrl.node.stats import Download
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity


def receipt(coordinator: Identity, node_id: str, prompt: str = "l1.0", tokens: int = 12) -> m.Receipt:
    return m.Receipt.sign(coordinator, node_id=node_id, lease_id="l1", prompt_id=prompt, policy_version=3,
                          tokens=tokens, accepted_at=time.time())


def test_receipts_verify_and_refuse_forgeries() -> None:
    coordinator, node, other = Identity.generate(), Identity.generate(), Identity.generate()
    r = receipt(coordinator, node.node_id)
    assert m.verify_receipt(r, coordinator.public_key_hex, node.node_id) is None
    assert m.verify_receipt(r, other.public_key_hex).startswith("bad signature")
    assert "not to this node" in m.verify_receipt(r, coordinator.public_key_hex, other.node_id)
    inflated = r.model_copy(update={"tokens": 10_000})
    assert m.verify_receipt(inflated, coordinator.public_key_hex).startswith("bad signature")
    with pytest.raises(ValidationError):
        m.Receipt.model_validate({**r.model_dump(), "tokens": -1})
    # Today's coordinator sends no receipts: the field is optional, and a result with them parses.
    assert m.SubmitResult.model_validate({"accepted": [], "rejected": {}}).receipts == []
    assert m.SubmitResult.model_validate_json(m.SubmitResult(accepted=["l1.0"], rejected={}, receipts=[r])
                                              .model_dump_json()).receipts == [r]


def test_receipt_book_keeps_each_valid_receipt_once(tmp_path: Path) -> None:
    coordinator, node, forger = Identity.generate(), Identity.generate(), Identity.generate()
    path = tmp_path / "receipts.jsonl"
    book = ReceiptBook(path, node.node_id, coordinator.public_key_hex)
    good = [receipt(coordinator, node.node_id, "l1.0", 10), receipt(coordinator, node.node_id, "l1.1", 20)]
    forged = receipt(forger, node.node_id, "l1.2", 1000)
    refused = book.add([*good, forged])
    assert len(refused) == 1 and "bad signature" in refused[0]
    assert book.add(good) == []  # a retried submission's receipts again: not kept twice
    assert (book.count, book.tokens) == (2, 30)
    assert len(path.read_text().splitlines()) == 2
    # After a restart the file is read back and checked again; another pool's receipts are not counted here.
    ReceiptBook(path, node.node_id, Identity.generate().public_key_hex).add([receipt(forger, node.node_id, "x.0")])
    again = ReceiptBook(path, node.node_id, coordinator.public_key_hex)
    assert (again.count, again.tokens) == (2, 30)


def test_node_counts_a_result_with_receipts(tmp_path: Path) -> None:
    coordinator = Identity.generate()
    node = Node(NodeConfig(key_path=tmp_path / "node.key", work_dir=tmp_path / "node", progress=False))
    node.receipts = ReceiptBook(tmp_path / "node" / "receipts.jsonl", node.identity.node_id,
                                coordinator.public_key_hex)
    rollout = m.Rollout(seed=1, completion_ids=[4, 5, 2], logprobs=[-0.1, -0.2, -0.3], finish_reason="stop")
    groups = [m.RolloutGroup(prompt_id=f"l1.{i}", prompt_ids=[1, 4], rollouts=[rollout, rollout]) for i in range(3)]
    submission = m.RolloutSubmission(lease_id="l1", policy_version=0, groups=groups)
    result = m.SubmitResult(accepted=["l1.0"], rejected={"l1.1": "already submitted", "l1.2": "bad shape"},
                            receipts=[receipt(coordinator, node.identity.node_id, "l1.0", 6)])
    node._count_result(submission, result)
    s = node.stats
    assert (s.groups_submitted, s.groups_accepted, s.groups_rejected) == (3, 2, 1)
    assert s.accepted_tokens == 12 and s.last_rejection == "l1.2: bad shape"
    assert (s.receipts, s.receipt_tokens) == (1, 6)

    node.coordinator_key = coordinator.public_key_hex
    node.download = Download(version=4, shards=40, bytes=84_000_000, counter_at_start=0)
    console = Console(width=140, record=True)
    console.print(render(node, "alpha"))
    node.client.outage.failed("ConnectError: refused")
    console.print(render(node, "alpha"))
    text = console.export_text()
    for fact in ("alpha", coordinator.public_key_hex[:16], "v4: 0/40 shards", "accepted 2", "rejected 1",
                 "l1.2: bad shape", "12 accepted tokens", "receipts 1 (6 tokens)", "reachable",
                 "unreachable for 0 s (ConnectError: refused; 1 tries)"):
        assert fact in text, fact
