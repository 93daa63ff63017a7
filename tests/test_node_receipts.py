"""What a node keeps and shows: the coordinator's signed receipts (collected from the coordinator, checked, appended
to receipts.jsonl once each, counted again after a restart) and the live panel's contents."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pydantic import ValidationError
from rich.console import Console

from swarmrl.node.agent import Node
from swarmrl.node.config import NodeConfig
from swarmrl.node.receipts import ReceiptBook, collect_receipts
from swarmrl.node.runner import render
from swarmrl.node.stats import Download
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.receipts import Receipt, ReceiptPage, verify_receipt


def receipt(coordinator: Identity, node_id: str, prompt: str = "l1.0", tokens: int = 12, seq: int = 1) -> Receipt:
    return Receipt.sign(coordinator, run_id="r", seq=seq, node_id=node_id, lease_id="l1", prompt_id=prompt,
                        policy_version=3, tokens=tokens, accepted_at=time.time())


def test_receipts_verify_and_refuse_forgeries() -> None:
    coordinator, node, other = Identity.generate(), Identity.generate(), Identity.generate()
    r = receipt(coordinator, node.node_id)
    assert verify_receipt(r, coordinator.public_key_hex, node.node_id) is None
    assert verify_receipt(r, other.public_key_hex).startswith("bad signature")
    assert "not to this node" in verify_receipt(r, coordinator.public_key_hex, other.node_id)
    for change in ({"tokens": 10_000}, {"seq": 2}, {"run_id": "other"}, {"policy_version": 4}):
        assert verify_receipt(r.model_copy(update=change), coordinator.public_key_hex).startswith("bad signature")
    with pytest.raises(ValidationError):
        Receipt.model_validate({**r.model_dump(), "tokens": -1})
    # The domain prefix: the same bytes signed without it are not a receipt.
    bare = r.model_copy(update={"signature": coordinator.sign(r.signed_bytes().split(b"\n", 1)[1])})
    assert verify_receipt(bare, coordinator.public_key_hex).startswith("bad signature")


def test_receipts_are_checked_and_shown_for_one_run(tmp_path: Path) -> None:
    """One coordinator key may serve several runs: `ledger --verify` checks every receipt against one run and
    prints it (the first valid line's run, or --run-id)."""
    import subprocess
    import sys

    from swarmrl.ledgercmd import check_receipts

    coordinator, node = Identity.generate(), Identity.generate()
    mine = receipt(coordinator, node.node_id, "a")
    theirs = Receipt.sign(coordinator, **{**mine.model_dump(exclude={"signature"}), "run_id": "other-run",
                                          "prompt_id": "b"})
    assert verify_receipt(theirs, coordinator.public_key_hex, run_id="r") == "for run 'other-run', not 'r'"
    path = tmp_path / "receipts.jsonl"
    path.write_text(mine.model_dump_json() + "\n" + theirs.model_dump_json() + "\n")
    checked = check_receipts(path, coordinator.public_key_hex)
    assert (checked.valid, checked.run_id) == (1, "r")
    assert [n for n, _ in checked.refused] == [2] and "not 'r'" in checked.refused[0][1]
    other = check_receipts(path, coordinator.public_key_hex, run_id="other-run")
    assert (other.valid, other.run_id, [n for n, _ in other.refused]) == (1, "other-run", [1])
    cli = subprocess.run([sys.executable, "-m", "swarmrl.cli", "ledger", "--verify", str(path), "--coordinator-key",
                          coordinator.public_key_hex, "--run-id", "r"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1 and "1 valid receipts of run r" in cli.stdout, cli
    assert "line 2" in cli.stderr and "other-run" in cli.stderr


def test_receipt_book_keeps_each_valid_receipt_once(tmp_path: Path) -> None:
    coordinator, node, forger = Identity.generate(), Identity.generate(), Identity.generate()
    path = tmp_path / "receipts.jsonl"
    book = ReceiptBook(path, node.node_id, coordinator.public_key_hex)
    good = [receipt(coordinator, node.node_id, "l1.0", 10, 1), receipt(coordinator, node.node_id, "l1.1", 20, 2)]
    forged = receipt(forger, node.node_id, "l1.2", 1000, 9)
    refused = book.add([*good, forged])
    assert len(refused) == 1 and "bad signature" in refused[0]
    assert book.add(good) == []  # the same receipts again: not kept twice
    assert (book.count, book.tokens, book.cursor) == (2, 30, 2)
    assert len(path.read_text().splitlines()) == 2
    # After a restart the file is read back and checked again; another pool's receipts are not counted here.
    ReceiptBook(path, node.node_id, Identity.generate().public_key_hex).add([receipt(forger, node.node_id, "x.0")])
    again = ReceiptBook(path, node.node_id, coordinator.public_key_hex)
    assert (again.count, again.tokens, again.cursor) == (2, 30, 2)


class Pages:
    """A coordinator's receipt book as GET /v1/receipts pages it (the API itself is tested in test_ledger.py)."""

    def __init__(self, receipts: list[Receipt]):
        self.held, self.asked = receipts, []

    def receipts(self, after: int = 0, limit: int = 200) -> ReceiptPage:
        self.asked.append(after)
        got = [r for r in self.held if r.seq > after][:limit]
        head = max((r.seq for r in self.held), default=0)
        return ReceiptPage(receipts=got, next_after=got[-1].seq if got else after, head=head)


def test_collecting_pages_after_the_cursor_and_starts_over_for_a_new_book(tmp_path: Path) -> None:
    coordinator, node = Identity.generate(), Identity.generate()
    book = ReceiptBook(tmp_path / "receipts.jsonl", node.node_id, coordinator.public_key_hex)
    first = [receipt(coordinator, node.node_id, f"a.{i}", 5, i + 1) for i in range(5)]
    source = Pages(first)
    assert collect_receipts(source, book, page_size=2) == 5
    assert source.asked == [0, 2, 4, 5] and (book.count, book.tokens, book.cursor) == (5, 25, 5)
    assert collect_receipts(source, book) == 0 and source.asked[-1] == 5  # nothing new: one request after 5
    # The coordinator lost its database (same key): its numbers start again below ours; everything is collected.
    source = Pages([receipt(coordinator, node.node_id, "b.0", 7, 1), first[0].model_copy()])
    assert collect_receipts(source, book) == 1
    assert source.asked[:2] == [5, 0] and (book.count, book.tokens) == (6, 32)


def test_node_counts_a_submission_result(tmp_path: Path) -> None:
    coordinator = Identity.generate()
    node = Node(NodeConfig(key_path=tmp_path / "node.key", work_dir=tmp_path / "node", progress=False))
    node.membership.receipts = ReceiptBook(tmp_path / "node" / "receipts.jsonl", node.identity.node_id,
                                           coordinator.public_key_hex)
    rollout = m.Rollout(seed=1, completion_ids=[4, 5, 2], logprobs=[-0.1, -0.2, -0.3], finish_reason="stop")
    groups = [m.RolloutGroup(prompt_id=f"l1.{i}", prompt_ids=[1, 4], rollouts=[rollout, rollout]) for i in range(3)]
    submission = m.RolloutSubmission(lease_id="l1", policy_version=0, groups=groups)
    result = m.SubmitResult(accepted=["l1.0"], rejected={"l1.1": "already submitted", "l1.2": "bad shape"})
    node.stats.count_result(submission, result)
    node.receipts.add([receipt(coordinator, node.identity.node_id, "l1.0", 6)])
    node.stats.receipts, node.stats.receipt_tokens = node.receipts.count, node.receipts.tokens
    s = node.stats
    assert (s.groups_submitted, s.groups_accepted, s.groups_rejected) == (3, 2, 1)
    assert s.accepted_tokens == 12 and s.last_rejection == "l1.2: bad shape"

    node.membership.coordinator_key = coordinator.public_key_hex
    node.weights.download = Download(version=4, shards=40, bytes=84_000_000, counter_at_start=0)
    console = Console(width=140, record=True)
    console.print(render(node, "alpha"))
    node.client.outage.failed("ConnectError: refused")
    console.print(render(node, "alpha"))
    text = console.export_text()
    for fact in ("alpha", coordinator.public_key_hex[:16], "v4: 0/40 shards", "accepted 2", "rejected 1",
                 "l1.2: bad shape", "12 accepted tokens", "receipts 1 (6 tokens)", "reachable",
                 "unreachable for 0 s (ConnectError: refused; 1 tries)"):
        assert fact in text, fact
