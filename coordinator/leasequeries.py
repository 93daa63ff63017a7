"""The statements of the lease tables (`leases`, `lease_prompts`) and of a submission's groups, for
`coordinator.leases`."""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy import BigInteger, Double, and_, bindparam, func, or_, select, text, update

from swarmrl.coordinator import inflight
from swarmrl.coordinator.db.fast import Prepared
from swarmrl.coordinator.db.rows import LeasePromptRow, LeaseRow
from swarmrl.coordinator.db.schema import CURRENT_VERSION, FEED_READ, lease_prompts, leases, nodes, rollout_groups
from swarmrl.coordinator.db.store import EncodedJSON, Tx, counter_query

_l, _p, _g = leases.c, lease_prompts.c, rollout_groups.c
_OPEN_LEASES = Prepared(select(func.count()).select_from(leases).where(
    _l.node_id == bindparam("b_node"), _l.state == "open", _l.expires_at > bindparam("b_now", type_=Double)))
# A submission's lease, locked, with the current version beside it: one statement where it was two.
_LEASE_AND_VERSION = Prepared(select(leases, counter_query(CURRENT_VERSION).scalar_subquery()).where(
    _l.id == bindparam("b_lease")).with_for_update())
_PROMPTS = Prepared(select(lease_prompts).where(_p.lease_id == bindparam("b_lease")).order_by(_p.position))
_MARK = Prepared(update(lease_prompts).where(
    _p.lease_id == bindparam("b_lease"), _p.prompt_id == bindparam("b_prompt"), _p.submitted.is_(False)
).values(submitted=True))
_INSERT_LEASE = Prepared(leases.insert(), keys=["id", "node_id", "policy_version", "issued_at", "expires_at",
                                                "sampling", "signature", "digests", "flight_n", "flight_class",
                                                "flight_source", "flight_stripe"])
_INSERT_PROMPT = Prepared(lease_prompts.insert(), keys=["lease_id", "prompt_id", "position", "text", "answer", "seeds"])
_LEASED = Prepared(update(nodes).where(nodes.c.id == bindparam("b_node")).values(
    prompts_leased=nodes.c.prompts_leased + bindparam("b_n", type_=BigInteger),
    in_flight=nodes.c.in_flight + bindparam("b_n", type_=BigInteger)))
# PostgreSQL: the lease, its prompts and its node's count in one statement (one round trip, not three). The prompts'
# foreign key is checked at the statement's end, where the lease's row is there.
_STORE_LEASE_PG = Prepared(text("""
WITH l AS (INSERT INTO leases (id, node_id, policy_version, issued_at, expires_at, sampling, signature, digests,
                               flight_n, flight_class, flight_source, flight_stripe)
           VALUES (:id, :node_id, :policy_version, :issued_at, :expires_at, CAST(:sampling AS JSON),
                   CAST(:signature AS JSON), CAST(:digests AS JSON), :flight_n, :flight_class, :flight_source,
                   :flight_stripe)),
     p AS (INSERT INTO lease_prompts (lease_id, prompt_id, position, text, answer, seeds)
           SELECT :id, prompt_id, position, text, answer, CAST(seeds AS JSON)
           FROM unnest(CAST(:prompt_ids AS TEXT[]), CAST(:positions AS INTEGER[]), CAST(:texts AS TEXT[]),
                       CAST(:answers AS TEXT[]), CAST(:seeds AS TEXT[])) AS t(prompt_id, position, text, answer, seeds))
UPDATE nodes SET prompts_leased = prompts_leased + :flight_n, in_flight = in_flight + :flight_n WHERE id = :node_id
"""))
_INSERT_GROUP = Prepared(rollout_groups.insert().returning(_g.id),
                         keys=["node_id", "lease_id", "prompt_id", "policy_version", "payload", "submitted_at"])
_BUFFERED = Prepared(select(func.count()).select_from(rollout_groups).where(
    _g.policy_version >= bindparam("b_min"),
    or_(and_(_g.status == "pending", _g.held.is_(False)),
        and_(_g.status == "accepted", _g.accepted_seq > counter_query(FEED_READ).scalar_subquery()))))
_EARLIEST = select(func.min(_l.expires_at)).where(_l.node_id == bindparam("b_node"), _l.state == "open",
                                                 _l.expires_at > bindparam("b_now", type_=Double))


def count_open_leases(tx: Tx, node_id: str, now: float) -> int:
    return int(_OPEN_LEASES.scalar(tx, b_node=node_id, b_now=now))


def insert_lease(tx: Tx, lease_id: str, node_id: str, policy_version: int, issued_at: float, expires_at: float,
                 sampling: dict[str, Any] | EncodedJSON, prompts: list[tuple[str, str, str, list[int]]],
                 signature: dict[str, Any] | EncodedJSON | None = None, digests: list[str] | EncodedJSON | None = None,
                 counted_as: tuple[str, str] = ("", ""), count_node: bool = False) -> dict[inflight.Key, int]:
    """Store a lease (with its signature and its prompts' digests, as signed) and its prompts, each (prompt_id,
    text, answer, seeds), counted in flight as `counted_as` (`inflight.counted_as`; ('', ''): nowhere), and with
    `count_node` in its node's record and own count in flight too (`nodes.prompts_leased`, `nodes.in_flight`). The
    shared counters' moves, for `inflight.apply`."""
    cls, source = counted_as
    stripe = inflight.stripe(node_id)
    lease = dict(id=lease_id, node_id=node_id, policy_version=policy_version, issued_at=issued_at,
                 expires_at=expires_at, sampling=sampling, signature=signature, digests=digests, flight_n=len(prompts),
                 flight_class=cls, flight_source=source, flight_stripe=stripe)
    deltas: dict[inflight.Key, int] = {}
    inflight.add_to(deltas, cls, source, policy_version, stripe, len(prompts))
    if count_node and tx.dialect.name == "postgresql":
        _STORE_LEASE_PG.rowcount(tx, **{k: _json(v) if k in _JSON_COLUMNS else v for k, v in lease.items()},
                                 prompt_ids=[p for p, _, _, _ in prompts], positions=list(range(len(prompts))),
                                 texts=[t for _, t, _, _ in prompts], answers=[a for _, _, a, _ in prompts],
                                 seeds=[orjson.dumps(s).decode() for _, _, _, s in prompts])
        return deltas
    _INSERT_LEASE.rowcount(tx, **lease)
    if prompts:
        _INSERT_PROMPT.many(tx, [dict(lease_id=lease_id, prompt_id=p, position=i, text=t, answer=a, seeds=s)
                                 for i, (p, t, a, s) in enumerate(prompts)])
    if count_node:
        _LEASED.rowcount(tx, b_node=node_id, b_n=len(prompts))
    return deltas


_JSON_COLUMNS = ("sampling", "signature", "digests")


def _json(value: Any) -> str | None:
    """A JSON column's value as the text the combined statement casts (`EncodedJSON` is that text already)."""
    if value is None or isinstance(value, str):
        return value
    return orjson.dumps(value).decode()


def lock_lease(tx: Tx, lease_id: str) -> tuple[LeaseRow, int] | None:
    """The lease, locked until the transaction ends (submissions of one lease take turns), and the current policy
    version (`current_version`); None for an unknown lease."""
    found = _LEASE_AND_VERSION.first_as_with(LeaseRow, tx, b_lease=lease_id)
    return None if found is None else (found[0], int(found[1][-1]))


def get_prompts(tx: Tx, lease_id: str) -> dict[str, LeasePromptRow]:
    """The lease's prompts by prompt id, in leased order, answers included (server side only)."""
    return {r.prompt_id: r for r in _PROMPTS.all_as(LeasePromptRow, tx, b_lease=lease_id)}


def mark_submitted(tx: Tx, lease_id: str, prompt_id: str) -> bool:
    """Flag a prompt submitted; False if it already was (so a racing duplicate cannot slip through)."""
    return _MARK.rowcount(tx, b_lease=lease_id, b_prompt=prompt_id) == 1


def insert_group(tx: Tx, node_id: str, lease_id: str, prompt_id: str, policy_version: int,
                 payload: dict[str, Any] | EncodedJSON, now: float) -> int:
    """A new pending group; its id."""
    return int(_INSERT_GROUP.scalar(tx, node_id=node_id, lease_id=lease_id, prompt_id=prompt_id,
                                    policy_version=policy_version, payload=payload, submitted_at=now))


# PostgreSQL: the prompt flagged and its group stored in one statement (one round trip, not two).
_TAKE_GROUP_PG = Prepared(text("""
WITH m AS (UPDATE lease_prompts SET submitted = true
           WHERE lease_id = :lease_id AND prompt_id = :prompt_id AND NOT submitted RETURNING prompt_id)
INSERT INTO rollout_groups (node_id, lease_id, prompt_id, policy_version, payload, submitted_at)
SELECT :node_id, :lease_id, m.prompt_id, :policy_version, CAST(:payload AS JSON), :submitted_at FROM m
RETURNING id
""").columns(id=BigInteger))


def take_group(tx: Tx, node_id: str, lease_id: str, prompt_id: str, policy_version: int, payload: EncodedJSON,
               now: float) -> bool:
    """`mark_submitted` and, when it was not submitted before, `insert_group`: whether the group was taken."""
    if tx.dialect.name == "postgresql":
        return _TAKE_GROUP_PG.first(tx, node_id=node_id, lease_id=lease_id, prompt_id=prompt_id,
                                    policy_version=policy_version, payload=str(payload), submitted_at=now) is not None
    if not mark_submitted(tx, lease_id, prompt_id):
        return False
    insert_group(tx, node_id, lease_id, prompt_id, policy_version, payload, now)
    return True


def buffered_groups(tx: Tx, min_version: int) -> int:
    """Submitted groups the pool still has to move along before the trainer has them: waiting for a verdict, or
    accepted and not yet handed to the trainer (`feed.read_cursor`); all of policy version >= `min_version`.
    Held groups are not counted: each waits for a later group of its own node, so counting them would withhold
    the very leases that release them (docs/liveness.md); the held cap bounds them per identity. (Leased prompts
    in flight are `coordinator.inflight`'s, counted per identity.)"""
    return int(_BUFFERED.scalar(tx, b_min=min_version))


def until_a_lease_expires(tx: Tx, node_id: str, now: float) -> float:
    """Seconds until the node's first open lease expires (at least 1): the Retry-After of a node whose leases are
    all it may hold."""
    earliest = tx.execute(_EARLIEST, {"b_node": node_id, "b_now": now}).scalar_one()
    return max((earliest if earliest is not None else now) - now, 1.0)
