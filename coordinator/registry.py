"""Nodes: registration by signed challenge, heartbeats and their time counters, verdict counters, bans.

A node is registered by redeeming a single-use challenge issued to its public key (stateless: a MAC under the
run's secret, `challenge_for`); it is never deleted, and a ban is final. Other modules change a node only through
the functions here (`touch`, `touch_settled`, `count_verdicts`, `count_check`, `ban`) and `coordinator.admission`'s
lease counters, inside their own transactions.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from sqlalchemy import BigInteger, Double, bindparam, func, select, update

from swarmrl.coordinator.auth import Refused, Signed
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.fast import Prepared
from swarmrl.coordinator.db.rows import NodeRow
from swarmrl.coordinator.db.schema import nodes
from swarmrl.coordinator.db.sqlite.asyncwriter import RemoteCall
from swarmrl.coordinator.db.store import Store, Tx, insert, load
from swarmrl.coordinator.db.writes import PlannedWrite, Writes
from swarmrl.coordinator.gate import admit
from swarmrl.coordinator.idempotency import remember
from swarmrl.coordinator.nonces import record_nonce
from swarmrl.coordinator.run_secret import RunSecret
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import node_id_from_public_key
from swarmrl.protocol.refusals import RefusalCode

# A node's idle + busy seconds cannot grow faster than the wall time between its heartbeats; this much more is
# allowed for network delay and clock rate differences before its counters are scaled down.
COUNTER_SLACK_FRAC = 0.05
COUNTER_SLACK_S = 10.0


# -- queries ----------------------------------------------------------------------------------------------

_c = nodes.c
_GET = select(nodes).where(_c.id == bindparam("b_id"))
_GET_LOCKED = Prepared(_GET.with_for_update())
_GET = Prepared(_GET)
_held = bindparam("b_held", type_=BigInteger)
_TOUCH_SETTLED = Prepared(update(nodes).where(_c.id == bindparam("b_id")).values(
    last_seen=bindparam("b_now", type_=Double), gone_since=None, held_version=func.coalesce(_held, _c.held_version),
    prompts_abandoned=_c.prompts_abandoned + bindparam("b_abandoned", type_=BigInteger),
    in_flight=_c.in_flight - bindparam("b_flight", type_=BigInteger)).returning(*_c))
_acc, _rej = bindparam("b_acc", type_=BigInteger), bindparam("b_rej", type_=BigInteger)
_COUNT = update(nodes).where(_c.id == bindparam("b_id")).values(
    groups_accepted=_c.groups_accepted + _acc, groups_rejected=_c.groups_rejected + _rej,
    checks_passed=_c.checks_passed + bindparam("b_checks", type_=BigInteger),
    # Reputation: the Laplace-smoothed acceptance rate.
    reputation=(_c.groups_accepted + _acc + 1.0) / (_c.groups_accepted + _c.groups_rejected + _acc + _rej + 2.0))

_now = bindparam("b_now", type_=Double)
_BEAT = Prepared(update(nodes).where(_c.id == bindparam("b_id")).values(
    last_seen=_now, gone_since=None, held_version=_held,
    idle_s=bindparam("b_idle", type_=Double), busy_s=bindparam("b_busy", type_=Double),
    idle_total=_c.idle_total + bindparam("b_add_idle", type_=Double),
    busy_total=_c.busy_total + bindparam("b_add_busy", type_=Double), counters_at=_now))


def get_node(tx: Tx, node_id: str, *, lock: bool = False) -> NodeRow | None:
    """The node's row; with `lock`, locked until the transaction ends (PostgreSQL), which serializes the
    requests of one node that read and then write it."""
    return (_GET_LOCKED if lock else _GET).first_as(NodeRow, tx, b_id=node_id)


def active(node: NodeRow | None) -> NodeRow:
    """`node`, if it is a registered node that is not banned; else Refused(403) saying which it is not."""
    if node is None:
        raise Refused(RefusalCode.UNKNOWN_NODE, "unknown node: register first")
    if node.banned:
        raise Refused(RefusalCode.BANNED, f"node is banned: {node.ban_reason}")
    return node


def require_node(tx: Tx, node_id: str, *, lock: bool = False) -> NodeRow:
    """The node's row; Refused(403) if it is unknown or banned."""
    return active(get_node(tx, node_id, lock=lock))


def list_nodes(tx: Tx, after: str = "", limit: int | None = None) -> list[NodeRow]:
    """Nodes in id order: those with ids after `after`, at most `limit` (a page; None: all)."""
    stmt = select(nodes).where(_c.id > after).order_by(_c.id)
    return [load(NodeRow, r) for r in tx.execute(stmt if limit is None else stmt.limit(limit))]


def node_counts(tx: Tx, gone_before: float) -> dict[str, int]:
    """Registered nodes: `total`, `banned`, `gone` (not banned, not heard from since `gone_before`), `live`."""
    live = _c.banned.is_(False) & (_c.last_seen >= gone_before)
    row = tx.execute(select(func.count(), func.count().filter(_c.banned.is_(True)), func.count().filter(live))
                     .select_from(nodes)).one()
    counts = {"total": int(row[0]), "banned": int(row[1]), "live": int(row[2])}
    counts["gone"] = counts["total"] - counts["banned"] - counts["live"]
    return counts


def _upsert(dialect: str) -> Prepared:
    stmt = insert(dialect, nodes)
    return Prepared(stmt.on_conflict_do_update(index_elements=[nodes.c.id], set_={
        "name": stmt.excluded.name, "engine": stmt.excluded.engine, "last_seen": stmt.excluded.last_seen,
        "source": stmt.excluded.source, "gone_since": None}),
        keys=["id", "public_key", "name", "engine", "registered_at", "last_seen", "source"])


# Built once: building this statement (its `excluded` columns) cost milliseconds, under the write lock, for every
# registration, which anyone with a fresh key may ask for.
_UPSERT = {"sqlite": _upsert("sqlite"), "postgresql": _upsert("postgresql")}


def upsert_node(tx: Tx, node_id: str, public_key: str, name: str, engine: str, now: float, source: str = "") -> None:
    """Register a node, or refresh its name, engine and source; counters and ban state are kept."""
    _UPSERT[tx.dialect.name].rowcount(tx, id=node_id, public_key=public_key, name=name, engine=engine,
                                      registered_at=now, last_seen=now, source=source)


def touch_settled(tx: Tx, node_id: str, now: float, held_version: int | None, settled: list[int] | None = None
                  ) -> NodeRow:
    """Note the node seen at `now` (holding `held_version`, if given; live again if it was gone), and the node's
    part of a settlement (`admission.Settlement.nodes`: [abandoned, no longer in flight])
    applied, in one statement; the node's row after both, locked until the transaction ends. Refused(403) if it is
    unknown or banned."""
    abandoned, flight = settled or (0, 0)
    return active(_TOUCH_SETTLED.first_as(NodeRow, tx, b_id=node_id, b_now=now, b_held=held_version,
                                          b_abandoned=abandoned, b_flight=flight))


def count_verdicts(tx: Tx, node_id: str, accepted: int = 0, rejected: int = 0, checks: int = 0) -> None:
    """Add to a node's verdict counters (its groups accepted and rejected, its full checks passed); reputation is
    its Laplace-smoothed acceptance rate."""
    tx.execute(_COUNT, {"b_id": node_id, "b_acc": accepted, "b_rej": rejected, "b_checks": checks})


def ban(tx: Tx, node_id: str, reason: str) -> None:
    """Ban a node for good; a node banned already keeps its first reason."""
    tx.execute(update(nodes).where(nodes.c.id == node_id, nodes.c.banned.is_(False))
               .values(banned=True, ban_reason=reason))


def note_beat(tx: Tx, node_id: str, now: float, held_version: int, idle_s: float, busy_s: float,
              add_idle: float, add_busy: float) -> None:
    """A heartbeat's write, in one statement: the node seen at `now` holding `held_version` (live again if it was
    gone), its latest self-reported counters stored (`idle_s`, `busy_s`, as reported) and added to its
    coordinator-side totals (`idle_total`, `busy_total`, which never decrease, whatever the node reports)."""
    _BEAT.rowcount(tx, b_id=node_id, b_now=now, b_held=held_version, b_idle=idle_s, b_busy=busy_s,
                   b_add_idle=add_idle, b_add_busy=add_busy)


def time_totals(tx: Tx) -> tuple[float, float]:
    """(idle, busy): the coordinator-side totals of every node, banned ones included, summed."""
    idle, busy = tx.execute(select(func.coalesce(func.sum(nodes.c.idle_total), 0.0),
                                   func.coalesce(func.sum(nodes.c.busy_total), 0.0))).one()
    return float(idle), float(busy)


def challenge_for(secret: RunSecret, public_key: str, expires_at: float) -> str:
    """A challenge only the holder of `public_key` can redeem, until `expires_at`: its expiry and a MAC of both
    under the run's secret, so that issuing one stores nothing (no table to fill, no cap to lock)."""
    expires_ms = int(expires_at * 1000)
    mac = secret.derive("challenge", f"{public_key}/{expires_ms}".encode()).hex()
    return f"{expires_ms:x}.{mac}"


def challenge_expiry(secret: RunSecret, challenge: str, public_key: str) -> float | None:
    """When `challenge` (issued to `public_key`) expires; None if it is not one of ours for that key."""
    head, _, mac = challenge.partition(".")
    try:
        expires_ms = int(head, 16)
    except ValueError:
        return None
    want = secret.derive("challenge", f"{public_key}/{expires_ms}".encode()).hex()
    return expires_ms / 1000 if hmac.compare_digest(mac, want) else None


def take_challenge(tx: Tx, secret: RunSecret, challenge: str, public_key: str, now: float) -> bool:
    """Redeem a challenge issued to `public_key` and still valid, once: it is remembered (with the nonces, until
    it expires) so that it cannot be redeemed again; False (nothing changed) otherwise."""
    expires_at = challenge_expiry(secret, challenge, public_key)
    if expires_at is None or expires_at < now:
        return False
    return record_nonce(tx, node_id_from_public_key(public_key), "challenge:" + challenge[-32:], expires_at)


# -- rules ------------------------------------------------------------------------------------------------


class Registry:
    """Registration and heartbeats."""

    def __init__(self, store: Store, config: CoordinatorConfig, clock: Callable[[], float], secret: RunSecret):
        self.store, self.config, self.clock, self.secret = store, config, clock, secret
        self.writes = Writes(store)
        """Where heartbeats are written (`coordinator.db.writes`; the server's, with the store's writer process)."""

    def challenge(self, req: m.ChallengeRequest) -> m.Challenge:
        """A fresh challenge that only `req.public_key` can redeem, once, within challenge_ttl_s. Nothing is stored:
        how many a source may ask for is `coordinator.ratelimit`'s."""
        key = req.public_key.lower()
        try:
            node_id = node_id_from_public_key(key)
        except ValueError:
            raise Refused(RefusalCode.BAD_PUBLIC_KEY, "public_key is not a hex Ed25519 public key") from None
        node = self.store.read(lambda tx: get_node(tx, node_id))
        if node is not None and node.banned:
            raise Refused(RefusalCode.BANNED, f"node is banned: {node.ban_reason}")
        expires_at = self.clock() + self.config.challenge_ttl_s
        return m.Challenge(challenge=challenge_for(self.secret, key, expires_at), expires_at=expires_at)

    def register(self, req: Signed, run_info: Callable[[Tx], m.RunInfo]) -> m.Registered:
        """Upsert the signer as a node registered from the request's source, redeeming a challenge issued to its
        key; its node id and `run_info`."""
        body: m.RegisterRequest = req.payload
        now = self.clock()

        def redeem(tx: Tx) -> m.Registered:
            admit(tx, req)
            node = get_node(tx, req.signer, lock=True)
            if node is not None and node.banned:
                raise Refused(RefusalCode.BANNED, f"node is banned: {node.ban_reason}")
            if not take_challenge(tx, self.secret, body.challenge, req.public_key, now):
                raise Refused(RefusalCode.BAD_CHALLENGE, "unknown, expired or already used challenge for this key")
            upsert_node(tx, req.signer, req.public_key, body.name, body.engine, now, req.source)
            answer = m.Registered(node_id=req.signer, run=run_info(tx))
            remember(tx, req, answer, now)
            return answer

        return self.store.write(redeem)

    def heartbeat(self, req: Signed) -> None:
        """Note the node alive, its held version, and its self-reported idle and busy counters.

        The counters are stored as reported and, as deltas, added to the node's coordinator-side totals that
        the per-step `node_idle_*` metrics are computed from: a counter below its previous value means the node
        restarted (its new values are the deltas); deltas that add up to more than the wall time since the
        node's previous heartbeat (plus slack) are scaled down to it, so a lying node skews only its own share.
        """
        self.writes.run(self.plan_heartbeat(req))

    def plan_heartbeat(self, req: Signed) -> PlannedWrite:
        """`heartbeat` up to its write (`coordinator.db.writes`), with its plain form when the store's writer process
        runs."""
        hb: m.Heartbeat = req.payload
        beat = [hb.idle_s, hb.busy_s, hb.held_version, self.clock()]
        # Not durable (coordinator.db.store): only metrics and liveness would be lost.
        remote = RemoteCall("heartbeat", [req.to_wire(), *beat], False, lambda _: None) if self.writes.crosses else None
        return PlannedWrite(self._beat(req, *beat), durable=False, remote=remote)

    def write_heartbeat(self, req: list[Any], *beat: Any) -> Callable[[Tx], None]:
        """In the writer process: the write of a heartbeat `heartbeat` sent."""
        return self._beat(Signed.from_wire(req), *beat)

    def _beat(self, req: Signed, idle_s: float, busy_s: float, held_version: int, now: float
              ) -> Callable[[Tx], None]:
        def beat(tx: Tx) -> None:
            admit(tx, req)
            node = require_node(tx, req.signer, lock=True)  # locked: two heartbeats at once count once each
            d_idle, d_busy = idle_s - node.idle_s, busy_s - node.busy_s
            if d_idle < 0 or d_busy < 0:  # restarted: the counters began again from 0
                d_idle, d_busy = idle_s, busy_s
            since = node.counters_at if node.counters_at is not None else node.registered_at
            allowed = max(now - since, 0.0) * (1 + COUNTER_SLACK_FRAC) + COUNTER_SLACK_S
            if d_idle + d_busy > allowed:
                scale = allowed / (d_idle + d_busy)
                d_idle, d_busy = d_idle * scale, d_busy * scale
            note_beat(tx, req.signer, now, held_version, idle_s, busy_s, d_idle, d_busy)

        return beat

