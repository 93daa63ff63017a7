"""`swarmrl ledger`: the contribution ledger, from a coordinator or from a node's own receipts.

    swarmrl ledger --url http://pool:8470 [--node NODE_ID] [--csv]
        every page of the coordinator's ledger: accepted groups and tokens per node and policy version
        (NODE_ID may be the first characters of the id, as every screen shows it, when no other id starts so)

    swarmrl ledger --verify node-data/receipts.jsonl --coordinator-key HEX [--run-id RUN] [--node NODE_ID] [--csv]
        offline, trusting nothing but the coordinator's public key: checks every receipt's signature, that it is of
        one run (RUN when given; the run is printed) and issued to NODE_ID (when given), and adds the valid ones up
        the same way; exit status 1 when any line is not a valid receipt, each such line said with why

Both print one table (or CSV with the columns node_id, name, policy_version, groups, tokens, last_accepted_at), so
a node's receipts can be set beside the operator's ledger.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from swarmrl.protocol.ledger import LedgerEntry
from swarmrl.protocol.pydantic_errors import describe_validation_error
from swarmrl.protocol.receipts import Receipt, verify_receipt

NODE_ID_LEN = 40  # hex digits of a whole node id (protocol.identity.node_id_from_public_key)
CSV_COLUMNS = ("node_id", "name", "policy_version", "groups", "tokens", "last_accepted_at")
PAGE = 1000


@dataclass
class Checked:
    """What a receipts file holds: the valid receipts added up per node and version, and each refused line."""

    entries: list[LedgerEntry]
    valid: int
    duplicates: int
    refused: list[tuple[int, str]]
    run_id: str | None = None
    """The run every valid receipt is of (None when there is none)."""


def fetch_ledger(url: str, node_id: str | None = None) -> list[LedgerEntry]:
    """Every entry of the coordinator's ledger (of one node, when given), page after page."""
    from swarmrl.runtime.client import CoordinatorClient

    out: list[LedgerEntry] = []
    with CoordinatorClient(url, retries=3) as client:
        client.info()  # a URL that is no coordinator is said in one line (NotACoordinator), not as a parse error
        after: int | None = 0
        while after is not None:
            page = client.ledger(after=after, limit=PAGE, node_id=node_id)
            out += page.entries
            after = page.next_after
    return out


class NodeIdError(ValueError):
    """A --node that names no node, or more than one; the message says which and what to give instead."""


def resolve_node_id(given: str, known: Iterable[str], where: str) -> str:
    """The one id among `known` that starts with `given` (a whole id, or the 10-12 characters screens show);
    NodeIdError when none or several do, saying so (`where`: what was searched)."""
    prefix = given.strip().lower()
    if not prefix or any(c not in "0123456789abcdef" for c in prefix):
        raise NodeIdError(f"--node {given!r} is not a node id (hex digits, or the first ones of an id)")
    found = sorted({k for k in known if k.startswith(prefix)})
    if not found:
        raise NodeIdError(f"no node id in {where} starts with {prefix!r}: check --node")
    if len(found) > 1:
        shown = ", ".join(f[:len(prefix) + 4] + "…" for f in found[:5])
        raise NodeIdError(f"--node {prefix!r} is the start of {len(found)} node ids in {where} ({shown}): give more of "
                          "its characters")
    return found[0]


def _receipt_node_ids(path: Path) -> set[str]:
    ids = set()
    for line in path.read_text().splitlines():
        try:
            ids.add(Receipt.model_validate_json(line).node_id)
        except ValidationError:
            continue  # check_receipts reports the line
    return ids


def _pool_node_ids(url: str) -> list[str]:
    """Every node id the coordinator at `url` knows (its node list, page after page)."""
    from swarmrl.runtime.client import CoordinatorClient

    with CoordinatorClient(url, retries=3) as client:
        client.info()  # as in fetch_ledger
        return [n.node_id for n in client.nodes()]


def check_receipts(path: Path, coordinator_key: str, node_id: str | None = None, run_id: str | None = None
                   ) -> Checked:
    """Check every line of a receipts file against `coordinator_key` (and `node_id`); add up the valid ones. All of
    them must be of one run: `run_id`, else the run of the first valid line (the others are refused, saying so)."""
    sums: dict[tuple[str, int], list[float]] = {}
    seen: set[tuple[str, str]] = set()
    refused: list[tuple[int, str]] = []
    valid = duplicates = 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            receipt = Receipt.model_validate_json(line)
        except ValidationError as e:
            refused.append((n, f"not a receipt: {describe_validation_error(e, limit=2, root='line')}"))
            continue
        problem = verify_receipt(receipt, coordinator_key, node_id, run_id)
        if problem is not None and run_id is None and problem.startswith("for run"):
            problem += " (the first valid line's run: give --run-id to check another)"
        if problem is None and run_id is None:
            run_id = receipt.run_id
        if problem is not None:
            refused.append((n, problem))
            continue
        if (receipt.lease_id, receipt.prompt_id) in seen:  # the same group twice: credited once
            duplicates += 1
            continue
        seen.add((receipt.lease_id, receipt.prompt_id))
        valid += 1
        s = sums.setdefault((receipt.node_id, receipt.policy_version), [0, 0, 0.0])
        s[0], s[1], s[2] = s[0] + 1, s[1] + receipt.tokens, max(s[2], receipt.accepted_at)
    entries = [LedgerEntry(node_id=k[0], name="", policy_version=k[1], groups=int(v[0]), tokens=int(v[1]),
                           last_accepted_at=v[2], cursor=i)
               for i, (k, v) in enumerate(sorted(sums.items()), 1)]
    return Checked(entries, valid, duplicates, refused, run_id if valid else None)


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")


def print_entries(entries: list[LedgerEntry], title: str, as_csv: bool) -> None:
    if as_csv:
        w = csv.writer(sys.stdout)
        w.writerow(CSV_COLUMNS)
        for e in entries:
            w.writerow([e.node_id, e.name, e.policy_version, e.groups, e.tokens, f"{e.last_accepted_at:.3f}"])
        return
    table = Table(title=title, title_justify="left")
    for col in ("node", "name", "version", "groups", "tokens", "last accepted (UTC)"):
        table.add_column(col, justify="right" if col in ("version", "groups", "tokens") else "left")
    for e in entries:
        # Names are untrusted node input: added as plain text, never as markup.
        table.add_row(e.node_id[:12], e.name, str(e.policy_version), f"{e.groups:,}", f"{e.tokens:,}",
                      _when(e.last_accepted_at))
    table.add_section()
    table.add_row("total", "", "", f"{sum(e.groups for e in entries):,}", f"{sum(e.tokens for e in entries):,}", "")
    Console(highlight=False).print(table)


def ledger_command(url: str | None, node_id: str | None, as_csv: bool, verify: Path | None,
                   coordinator_key: str | None, run_id: str | None = None) -> None:
    if verify is not None:
        if not coordinator_key:
            sys.exit("swarmrl ledger --verify: give the pool's key with --coordinator-key (offline: nothing else is "
                     "trusted)")
        if not verify.is_file():
            sys.exit(f"swarmrl ledger --verify: no file {verify}")
        if node_id is not None and len(node_id) != NODE_ID_LEN:
            try:
                node_id = resolve_node_id(node_id, _receipt_node_ids(verify), str(verify))
            except NodeIdError as e:
                sys.exit(f"swarmrl ledger: {e}")
        checked = check_receipts(verify, coordinator_key.strip().lower(), node_id, run_id)
        run = f" of run {checked.run_id}" if checked.run_id else ""
        print_entries(checked.entries, f"{checked.valid} valid receipts{run} in {verify}", as_csv)
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        if checked.duplicates:
            err.print(f"{checked.duplicates} duplicate lines (a group already credited) counted once")
        for n, why in checked.refused:
            err.print(f"[red]line {n}:[/] {escape(why)}")
        if checked.refused:
            sys.exit(1)
        return
    if url is None:
        sys.exit("swarmrl ledger: give --url (the coordinator's ledger) or --verify FILE (a node's receipts)")
    import httpx

    from swarmrl.runtime.client import CoordinatorError

    try:
        if node_id is not None and len(node_id) != NODE_ID_LEN:
            node_id = resolve_node_id(node_id, _pool_node_ids(url), f"the pool at {url}")
        entries = fetch_ledger(url, node_id)
    except NodeIdError as e:
        sys.exit(f"swarmrl ledger: {e}")
    except (CoordinatorError, OSError, httpx.HTTPError) as e:
        sys.exit(f"swarmrl ledger: {url}: {e}")
    print_entries(entries, f"ledger of {url}", as_csv)
