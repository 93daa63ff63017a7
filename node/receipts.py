"""The node's receipts: the coordinator's signed word for each group of its work it accepted.

The coordinator signs a receipt when the verifier's verdict accepting a group is applied, which is some time after
the node submitted it; the node collects them (`collect_receipts`, from its main loop every
`receipts_interval_s`) with a signed GET /v1/receipts after the last receipt number it holds. Each receipt is
checked (the coordinator's signature, issued to this node) before it is appended, one JSON object per line, to
`<work_dir>/receipts.jsonl`; a receipt already held (same lease and prompt) is not written twice, so collecting
again cannot double what the file says was earned. Reading the file back needs nothing but the coordinator's
public key: `verify_receipt` on each line (`swarmrl ledger --verify`).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from swarmrl.protocol.receipts import Receipt, ReceiptPage, verify_receipt

log = logging.getLogger("swarmrl.node")

RECEIPTS_FILE = "receipts.jsonl"


class ReceiptBook:
    """The receipts held in `path` for `node_id`, signed by `coordinator_key`."""

    def __init__(self, path: Path, node_id: str, coordinator_key: str):
        self.path = Path(path)
        self.node_id = node_id
        self.coordinator_key = coordinator_key
        self.count = 0
        self.tokens = 0
        self.cursor = 0
        """The largest receipt number held from this coordinator: receipts are collected after it."""
        self._held: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        for n, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                receipt = Receipt.model_validate_json(line)
            except ValidationError:
                log.warning("%s line %d is not a receipt: skipped", self.path, n)
                continue
            # Receipts of another pool (another coordinator key) stay in the file but are not counted here.
            if verify_receipt(receipt, self.coordinator_key, self.node_id) is None:
                self._count(receipt)

    def _count(self, receipt: Receipt) -> None:
        self._held.add((receipt.lease_id, receipt.prompt_id))
        self.count += 1
        self.tokens += receipt.tokens
        self.cursor = max(self.cursor, receipt.seq)

    def add(self, receipts: list[Receipt]) -> list[str]:
        """Keep every valid receipt not held yet (appended and fsynced before this returns); the reasons the
        others were refused (a duplicate is not refused, just not kept twice)."""
        refused, new = [], []
        with self._lock:
            for r in receipts:
                problem = verify_receipt(r, self.coordinator_key, self.node_id)
                if problem is not None:
                    refused.append(f"receipt for {r.prompt_id}: {problem}")
                elif (r.lease_id, r.prompt_id) not in self._held:
                    new.append(r)
                    self._count(r)
                else:
                    self.cursor = max(self.cursor, r.seq)
            if new:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a") as f:
                    f.write("".join(r.model_dump_json() + "\n" for r in new))
                    f.flush()
                    os.fsync(f.fileno())
        for why in refused:
            log.warning("refused a %s", why)
        return refused


class ReceiptSource(Protocol):
    def receipts(self, after: int = 0, limit: int = 200) -> ReceiptPage: ...


def collect_receipts(client: ReceiptSource, book: ReceiptBook, page_size: int = 200) -> int:
    """Fetch every receipt the coordinator holds for this node after `book.cursor` and keep the valid ones; how
    many new ones were kept.

    A coordinator whose receipt numbers stop below the book's cursor lost its receipt book (a new database under
    the same key): its receipts are collected from the start (those already held are not kept twice)."""
    before = book.count
    after = book.cursor
    while True:
        page = client.receipts(after=after, limit=page_size)
        if page.head < after:
            log.warning("the coordinator's receipts end at %d, below the %d held (a new database?): collecting "
                        "its receipts from the start", page.head, after)
            book.cursor = after = 0
            continue
        if not page.receipts or page.next_after <= after:  # the end (or a cursor that does not move on)
            return book.count - before
        book.add(page.receipts)
        after = page.next_after
