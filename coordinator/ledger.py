"""The contribution ledger: a signed receipt for every accepted group, and per node and policy version the groups
and completion tokens accepted.

Both are written by `Ledger.issue`, which `coordinator.verification` calls in the very transaction that accepts
groups (a verdict, or a release from quarantine): a group is accepted with its receipt and its ledger entry, or not
at all. Receipts are numbered by the RECEIPT_SEQ counter, whose row lock (taken after the feed head's, which every
verdict batch locks first) makes the numbers gap-free and ordered as their transactions commit, so a node that has
collected every receipt up to `seq` misses none by asking for those after it.

Nodes collect their receipts with a signed request (`receipts_page`); anyone may read the ledger (`page`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from sqlalchemy import BigInteger, bindparam, func, select

from swarmrl.coordinator.auth import Signed
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.schema import RECEIPT_SEQ, ledger, nodes, receipts, rollout_groups
from swarmrl.coordinator.db.store import Store, Tx, add_to_counter, counter, insert
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.ledger import Contributors, LedgerEntry, LedgerPage, NodeContribution
from swarmrl.protocol.receipts import Receipt, ReceiptPage, ReceiptsRequest

BACKFILL_BATCH = 500

_g, _r, _l = rollout_groups.c, receipts.c, ledger.c
_ids = bindparam("b_ids", expanding=True)
_ACCEPTED = (select(_g.id, _g.node_id, _g.lease_id, _g.prompt_id, _g.policy_version, _g.payload, _g.decided_at)
             .where(_g.id.in_(_ids), _g.status == "accepted").order_by(_g.id))
_WITHOUT_RECEIPT = (select(_g.id).select_from(rollout_groups.outerjoin(receipts, _r.group_id == _g.id))
                    .where(_g.status == "accepted", _r.group_id.is_(None)).order_by(_g.id)
                    .limit(bindparam("b_limit")))
_NODE_RECEIPTS = (select(_r.body)
                  .where(_r.node_id == bindparam("b_node"), _r.seq > bindparam("b_after", type_=BigInteger))
                  .order_by(_r.seq).limit(bindparam("b_limit")))
_NODE_HEAD = select(func.coalesce(func.max(_r.seq), 0)).where(_r.node_id == bindparam("b_node"))
_TOTALS = select(func.coalesce(func.sum(_l.groups), 0), func.coalesce(func.sum(_l.tokens), 0))


def completion_tokens(payload: dict[str, Any]) -> int:
    """Completion tokens of a group as submitted (its rollouts' lengths summed): what a receipt credits."""
    return sum(len(r["completion_ids"]) for r in payload["rollouts"])


def _add_to_ledger(tx: Tx, node_id: str, version: int, groups: int, tokens: int, at: float) -> None:
    stmt = insert(tx, ledger).values(node_id=node_id, policy_version=version, groups=groups, tokens=tokens,
                                     last_accepted_at=at)
    tx.execute(stmt.on_conflict_do_update(index_elements=[_l.node_id, _l.policy_version], set_={
        "groups": _l.groups + stmt.excluded.groups, "tokens": _l.tokens + stmt.excluded.tokens,
        "last_accepted_at": func.max(_l.last_accepted_at, stmt.excluded.last_accepted_at)
        if tx.dialect.name == "sqlite" else func.greatest(_l.last_accepted_at, stmt.excluded.last_accepted_at)}))


def totals(tx: Tx) -> tuple[int, int, int]:
    """(groups, tokens) accepted over the whole ledger, and receipts signed so far."""
    groups, tokens = tx.execute(_TOTALS).one()
    return int(groups), int(tokens), counter(tx, RECEIPT_SEQ)


def ledger_entries(tx: Tx, after: int, limit: int, node_id: str | None = None) -> list[LedgerEntry]:
    """Up to `limit` ledger entries after cursor `after` (in the order they were first written), of one node or
    of all."""
    q = (select(_l.id, _l.node_id, _l.policy_version, _l.groups, _l.tokens, _l.last_accepted_at, nodes.c.name)
         .select_from(ledger.join(nodes, nodes.c.id == _l.node_id)).where(_l.id > after).order_by(_l.id).limit(limit))
    if node_id is not None:
        q = q.where(_l.node_id == node_id)
    return [LedgerEntry(node_id=r.node_id, name=r.name, policy_version=r.policy_version, groups=r.groups,
                        tokens=r.tokens, last_accepted_at=r.last_accepted_at, cursor=r.id) for r in tx.execute(q)]


def top_contributors(tx: Tx, limit: int) -> list[NodeContribution]:
    """Up to `limit` nodes with the most accepted tokens, summed over every policy version, most first."""
    q = (select(_l.node_id, nodes.c.name, func.sum(_l.groups).label("groups"), func.sum(_l.tokens).label("tokens"),
                func.count().label("versions"), func.max(_l.last_accepted_at).label("last"))
         .select_from(ledger.join(nodes, nodes.c.id == _l.node_id)).group_by(_l.node_id, nodes.c.name)
         .order_by(func.sum(_l.tokens).desc(), _l.node_id).limit(limit))
    return [NodeContribution(node_id=r.node_id, name=r.name, groups=int(r.groups), tokens=int(r.tokens),
                             versions=int(r.versions), last_accepted_at=float(r.last)) for r in tx.execute(q)]


class Ledger:
    """Signs receipts with the coordinator's `identity` for the run in `config`, and reads the ledger."""

    def __init__(self, store: Store, config: CoordinatorConfig, identity: Identity, clock: Callable[[], float]):
        self.store, self.identity, self.clock = store, identity, clock
        self.run_id = config.run.run_id

    def issue(self, tx: Tx, group_ids: list[int], now: float) -> list[Receipt]:
        """Sign a receipt for each of these groups (accepted in this transaction `tx`) and add them to the ledger.
        Groups that are not accepted are left out. The receipts, in group order."""
        if not group_ids:
            return []
        rows = tx.execute(_ACCEPTED, {"b_ids": sorted(set(group_ids))}).all()
        if not rows:
            return []
        last = add_to_counter(tx, RECEIPT_SEQ, len(rows))
        out, values = [], []
        sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0, 0.0])
        for seq, row in enumerate(rows, last - len(rows) + 1):
            at = row.decided_at if row.decided_at is not None else now
            tokens = completion_tokens(row.payload)
            receipt = Receipt.sign(self.identity, run_id=self.run_id, seq=seq, node_id=row.node_id,
                                   lease_id=row.lease_id, prompt_id=row.prompt_id, policy_version=row.policy_version,
                                   tokens=tokens, accepted_at=at)
            out.append(receipt)
            values.append({"seq": seq, "group_id": row.id, "node_id": row.node_id, "policy_version": row.policy_version,
                           "tokens": tokens, "accepted_at": at, "body": receipt.model_dump_json()})
            s = sums[(row.node_id, row.policy_version)]
            s[0], s[1], s[2] = s[0] + 1, s[1] + tokens, max(s[2], at)
        tx.execute(receipts.insert(), values)
        for (node_id, version), (groups, tokens, at) in sorted(sums.items()):
            _add_to_ledger(tx, node_id, version, int(groups), int(tokens), at)
        return out

    def backfill(self, batch: int = BACKFILL_BATCH) -> int:
        """Issue the receipts of accepted groups that have none (groups accepted before the ledger existed);
        how many. Batches take the receipt counter's lock first, so coordinators starting at once on one
        PostgreSQL database never sign one group twice."""

        def one_batch(tx: Tx) -> int:
            counter(tx, RECEIPT_SEQ, lock=True)
            ids = list(tx.execute(_WITHOUT_RECEIPT, {"b_limit": batch}).scalars())
            return len(self.issue(tx, ids, self.clock()))

        done = 0
        while n := self.store.write(one_batch):
            done += n
        return done

    def receipts_page(self, req: Signed) -> ReceiptPage:
        """The signer's receipts after `req.payload.after`, oldest first."""
        body: ReceiptsRequest = req.payload

        def read(tx: Tx) -> ReceiptPage:
            args = {"b_node": req.signer, "b_after": body.after, "b_limit": body.limit}
            got = [Receipt.model_validate_json(b) for b in tx.execute(_NODE_RECEIPTS, args).scalars()]
            head = int(tx.execute(_NODE_HEAD, {"b_node": req.signer}).scalar_one())
            return ReceiptPage(receipts=got, next_after=got[-1].seq if got else body.after, head=head)

        return self.store.read(read)

    def contributors(self, limit: int) -> Contributors:
        """The `limit` largest contributors (`top_contributors`)."""
        return Contributors(nodes=self.store.read(lambda tx: top_contributors(tx, limit)))

    def page(self, after: int, limit: int, node_id: str | None = None) -> LedgerPage:
        """A page of the ledger (see `ledger_entries`), with the cursor of the next one."""
        entries = self.store.read(lambda tx: ledger_entries(tx, after, limit, node_id))
        return LedgerPage(entries=entries, next_after=entries[-1].cursor if len(entries) == limit else None)

