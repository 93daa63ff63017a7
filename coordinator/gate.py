"""The one door every signed request comes through, before any rule of the coordinator sees it.

`Gate.open` checks, in this order, each refusal with its own status: a well-formed envelope (422), the signature,
kind and clock window (401), a nonce not seen before from this signer (409), a payload of the endpoint's schema
(422: every integer bounded, so nothing oversized reaches the database), and the signer's role (403). The nonce
is committed before anything else is looked at, in a transaction of its own: even a request refused later
cannot be replayed. Cross-cutting checks that later work adds for every request (idempotency keys, rate
limits) belong here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel
from sqlalchemy import delete

from swarmrl.coordinator.auth import Refused, Signed, check_signature, parse_envelope, typed_payload
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.rows import NodeRow
from swarmrl.coordinator.db.schema import nonces
from swarmrl.coordinator.db.store import Store, Tx, insert
from swarmrl.coordinator.registry import active, get_node

T = TypeVar("T", bound=BaseModel)

PRUNE_EVERY_S = 10.0


_RECORD = {d: insert(d, nonces).on_conflict_do_nothing().returning(nonces.c.signer) for d in ("sqlite", "postgresql")}


def record_nonce(tx: Tx, signer: str, nonce: str, ts: float) -> bool:
    """Remember (signer, nonce); False if it was already recorded (a replay), in this process or another."""
    return tx.execute(_RECORD[tx.dialect.name], {"signer": signer, "nonce": nonce, "ts": ts}).first() is not None


def prune_nonces(tx: Tx, older_than: float) -> int:
    """Forget nonces whose timestamps are older than `older_than`; how many."""
    return tx.execute(delete(nonces).where(nonces.c.ts < older_than)).rowcount


class Gate:
    """Authenticates signed requests against `config` (clock window, operator keys) and the store (nonces,
    nodes)."""

    def __init__(self, store: Store, config: CoordinatorConfig, clock: Callable[[], float]):
        self.store, self.config, self.clock = store, config, clock
        self._operators = frozenset(k.lower() for k in config.operator_keys)
        self._last_prune = 0.0

    def open(self, raw: bytes | str, kind: str, model: type[T], role: str | None = None) -> Signed:
        """Authenticate a signed request for an endpoint of `kind` whose payload is a `model`.

        `role` is "node" (a registered, unbanned node), "operator" (a key in operator_keys) or None.
        """
        now = self.clock()
        env = parse_envelope(raw)
        check_signature(env, kind, now, self.config.clock_skew_s)

        def remember(tx: Tx) -> tuple[bool, NodeRow | None]:
            if now - self._last_prune > PRUNE_EVERY_S:
                # A nonce only needs remembering while its timestamp is inside the window; 2x for margin.
                self._last_prune = now
                prune_nonces(tx, now - 2 * self.config.clock_skew_s)
            new = record_nonce(tx, env.signer_id, env.nonce, env.timestamp)
            return new, get_node(tx, env.signer_id) if new and role == "node" else None  # read now, judged below

        new, node = self.store.write(remember, durable=False)  # see coordinator.db.store on why this may be lost
        if not new:
            raise Refused(409, "replayed request")
        payload = typed_payload(env, model)
        if role == "node":
            node = active(node)
        elif role == "operator":
            if env.public_key.lower() not in self._operators:
                raise Refused(403, "this key is not an operator key")
        return Signed(env, payload, node)
