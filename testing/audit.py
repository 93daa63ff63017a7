"""The audit of a run after the fact: the coordinator's database and the trainer's step log must agree that no
accepted group was lost or trained twice, that versions only went up, and that every count adds up.

What is checked (each failure is one line of `Audit.problems`):

- the trainer feed is gap-free: accepted groups hold positions 1..head, each once;
- counts add up: every submitted prompt has exactly one group, every group is pending, accepted or rejected,
  and the nodes' accepted and rejected counters sum to the groups accepted and rejected;
- the step log has one line per step, 1..S, with strictly increasing versions;
- no group was trained on twice, and everything the trainer consumed was an accepted group;
- none was lost: every accepted group up to the trainer's cursor was consumed (trained on, or passed over as
  stale or zero-advantage, which the log says), and every later one is still in the feed after the cursor;
- the acknowledged cursor never passed the trainer's, and the trainer's newest state agrees with its log;
- published versions went up in publishing order, the current version is the newest, and each one after the
  first is a version the trainer's log reached;
- the ledger agrees: one receipt per accepted group, and per node the ledger's groups are its accepted groups;
- the nodes' own receipt files (when given) hold only valid receipts, for accepted groups of that node, each once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from swarmrl.protocol.receipts import Receipt, verify_receipt
from swarmrl.trainer.state import latest, read_state, read_step_log


@dataclass
class Audit:
    problems: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def check(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)


def _rows(store_url: str, sql: str) -> list[tuple]:
    engine = create_engine(store_url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql))]
    finally:
        engine.dispose()


def audit(store_url: str, state_dir: Path, receipt_files: Sequence[Path] = (), coordinator_key: str = "") -> Audit:
    """Audit the run whose coordinator database is `store_url` and whose trainer state is in `state_dir` (every
    process of it stopped); `receipt_files`: nodes' receipts.jsonl, checked against `coordinator_key`."""
    a = Audit()
    _audit_feed_and_log(a, store_url, state_dir)
    _audit_ledger(a, store_url, receipt_files, coordinator_key)
    return a


def _audit_feed_and_log(a: Audit, store_url: str, state_dir: Path) -> None:
    kv = dict(_rows(store_url, "SELECT key, value FROM kv"))
    positions = sorted(p for (p,) in _rows(store_url, "SELECT accepted_seq FROM rollout_groups "
                                                      "WHERE accepted_seq IS NOT NULL"))
    head, acked = kv["accepted_seq"], kv["feed_acked"]
    a.check(positions == list(range(1, head + 1)), f"feed positions are not 1..{head} once each")
    by_status = dict(_rows(store_url, "SELECT status, COUNT(*) FROM rollout_groups GROUP BY status"))
    (groups,), = _rows(store_url, "SELECT COUNT(*) FROM rollout_groups")
    (submitted,), = _rows(store_url, "SELECT COUNT(*) FROM lease_prompts WHERE submitted")
    (node_acc, node_rej), = _rows(store_url, "SELECT COALESCE(SUM(groups_accepted), 0), "
                                             "COALESCE(SUM(groups_rejected), 0) FROM nodes")
    a.check(submitted == groups, f"{submitted} prompts submitted, {groups} groups stored")
    a.check(sum(by_status.values()) == groups, f"groups by status {by_status} do not add up to {groups}")
    a.check(by_status.get("accepted", 0) == len(positions), "accepted groups without a feed position")
    a.check(node_acc == by_status.get("accepted", 0), f"nodes count {node_acc} accepted, the groups say "
                                                      f"{by_status.get('accepted', 0)}")
    a.check(node_rej == by_status.get("rejected", 0), f"nodes count {node_rej} rejected, the groups say "
                                                      f"{by_status.get('rejected', 0)}")

    lines = read_step_log(state_dir)
    steps = [line["step"] for line in lines]
    versions = [line["version"] for line in lines]
    a.check(steps == list(range(1, len(lines) + 1)), f"step log steps are {steps}, not 1..{len(lines)}")
    a.check(all(x < y for x, y in zip(versions, versions[1:], strict=False)), f"versions not increasing: {versions}")
    trained = [g for line in lines for g in line["trained"]]
    consumed = set(trained) | {g for line in lines for g in line["skipped"]}
    a.check(len(trained) == len(set(trained)), "a group was trained on twice: "
            f"{sorted({g for g in trained if trained.count(g) > 1})}")
    a.check(consumed <= set(positions), f"consumed groups never accepted: {sorted(consumed - set(positions))}")
    cursor = lines[-1]["cursor"] if lines else 0
    lost = [p for p in positions if p <= cursor and p not in consumed]
    a.check(not lost, f"accepted groups up to the cursor {cursor} never consumed (lost): {lost}")
    a.check(cursor <= head and acked <= cursor, f"cursor {cursor}, acknowledged {acked}, head {head}")
    newest = latest(state_dir)
    if newest is not None and lines:
        state = read_state(newest)
        a.check((state.step, state.version, state.cursor) == (steps[-1], versions[-1], cursor),
                f"newest state {(state.step, state.version, state.cursor)} disagrees with the log's last line")

    published = [v for (v, _) in _rows(store_url, "SELECT version, published_at FROM manifests ORDER BY published_at")]
    a.check(all(x < y for x, y in zip(published, published[1:], strict=False)), f"published out of order: {published}")
    a.check(kv["current_version"] == (max(published) if published else -1), "current version is not the newest")
    a.check(set(published[1:]) <= set(versions), f"published versions the trainer never reached: "
                                                 f"{sorted(set(published[1:]) - set(versions))}")
    a.facts = {"accepted": len(positions), "rejected": by_status.get("rejected", 0),
               "pending": by_status.get("pending", 0), "steps": len(lines), "trained": len(trained),
               "skipped": len(consumed) - len(set(trained)), "in_feed_after_cursor": sum(p > cursor for p in positions),
               "published": published, "cursor": cursor, "acked": acked}


def _audit_ledger(a: Audit, store_url: str, receipt_files: Sequence[Path], coordinator_key: str) -> None:
    accepted = {(lease, prompt): node for lease, prompt, node in _rows(
        store_url, "SELECT lease_id, prompt_id, node_id FROM rollout_groups WHERE status = 'accepted'")}
    (receipts,), = _rows(store_url, "SELECT COUNT(*) FROM receipts")
    a.check(receipts == len(accepted), f"{receipts} receipts for {len(accepted)} accepted groups")
    per_node = dict(_rows(store_url, "SELECT node_id, SUM(groups) FROM ledger GROUP BY node_id"))
    counted: dict[str, int] = {}
    for node in accepted.values():
        counted[node] = counted.get(node, 0) + 1
    a.check({k: int(v) for k, v in per_node.items()} == counted, f"ledger {per_node} vs accepted {counted}")
    held = 0
    for path in receipt_files:
        seen: set[tuple[str, str]] = set()
        for line in path.read_text().splitlines() if path.exists() else []:
            receipt = Receipt.model_validate_json(line)
            key = (receipt.lease_id, receipt.prompt_id)
            a.check(verify_receipt(receipt, coordinator_key) is None, f"{path}: a receipt that does not verify")
            a.check(key not in seen, f"{path}: receipt for {key} held twice")
            a.check(accepted.get(key) == receipt.node_id, f"{path}: receipt for {key}, not an accepted group of "
                                                          f"{receipt.node_id[:12]}")
            seen.add(key)
        held += len(seen)
    a.facts["receipts"] = receipts
    a.facts["receipts_held_by_nodes"] = held


def describe(a: Audit) -> str:
    return "\n".join([*a.problems, f"facts: {a.facts}"])


def assert_clean(a: Audit) -> None:
    assert not a.problems, describe(a)


__all__ = ["Audit", "assert_clean", "audit", "describe"]
