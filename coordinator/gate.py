"""The one door every signed request comes through, before any rule of the coordinator sees it.

Two halves. `Gate.open` needs no database: a well-formed envelope (422), the signature, kind and clock window (401),
a payload of the endpoint's schema (422: every integer bounded, so nothing oversized reaches the database), an
operator key for operator endpoints (403), a well-formed Idempotency-Key (422). `admit` is the first thing the
transaction of the request's effect does: an earlier try's stored answer is answered again
(`coordinator.idempotency`), and a nonce seen before from this signer is refused (409). Being in that transaction,
the nonce commits with the effect, in one commit. A refused request rolls its transaction back, nonce included;
`Gate.keep_nonce` then records the nonce on its own (the one change a refused request makes), so that it cannot
be replayed either. Role rules that need the database (a registered, unbanned node) are the endpoint's, right
after `admit` (`coordinator.registry.require_node`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel
from sqlalchemy import delete

from swarmrl.coordinator.auth import Refused, Replayed, Signed, open_envelope, typed_payload
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.fast import Prepared
from swarmrl.coordinator.db.schema import nonces
from swarmrl.coordinator.db.store import Store, Tx, insert
from swarmrl.coordinator.idempotency import Answered, check_key, previous_answer, request_digest

T = TypeVar("T", bound=BaseModel)

_RECORD = {d: Prepared(insert(d, nonces).on_conflict_do_nothing().returning(nonces.c.signer),
                       keys=["signer", "nonce", "ts"]) for d in ("sqlite", "postgresql")}


def record_nonce(tx: Tx, signer: str, nonce: str, ts: float) -> bool:
    """Remember (signer, nonce); False if it was already recorded (a replay), in this process or another."""
    return _RECORD[tx.dialect.name].first(tx, signer=signer, nonce=nonce, ts=ts) is not None


def prune_nonces(tx: Tx, older_than: float) -> int:
    """Forget nonces whose timestamps are older than `older_than`; how many."""
    return tx.execute(delete(nonces).where(nonces.c.ts < older_than)).rowcount


def admit(tx: Tx, req: Signed) -> None:
    """The start of every signed request's transaction: `Answered` with the stored answer when this is a retry of a
    request already applied, Refused(422) for an Idempotency-Key reused for another request, Replayed (409) for a
    nonce seen before; otherwise the nonce is recorded (committed with the request's effect)."""
    earlier = previous_answer(tx, req)
    if earlier is not None:
        raise Answered(earlier)
    if not record_nonce(tx, req.signer, req.env.nonce, req.env.timestamp):
        raise Replayed()


class Gate:
    """Authenticates signed requests against `config` (clock window, operator keys)."""

    def __init__(self, store: Store, config: CoordinatorConfig, clock: Callable[[], float]):
        self.store, self.config, self.clock = store, config, clock
        self._operators = frozenset(k.lower() for k in config.operator_keys)

    def open(self, raw: bytes | str, kind: str, model: type[T], role: str | None = None,
             idempotency_key: str | None = None) -> Signed:
        """Authenticate a signed request for an endpoint of `kind` whose payload is a `model` (no database work).

        `role` "operator" requires a key in operator_keys; "node" and None are checked by the endpoint.
        `idempotency_key`: the request's Idempotency-Key header, for endpoints that store their answers.
        """
        env, payload_json = open_envelope(raw, kind, self.clock(), self.config.clock_skew_s)
        payload = typed_payload(env, model)
        if role == "operator" and env.public_key.lower() not in self._operators:
            raise Refused(403, "this key is not an operator key")
        key = check_key(idempotency_key)
        return Signed(env, payload, key, request_digest(kind, payload_json) if key is not None else "")

    def admit_alone(self, req: Signed) -> None:
        """`admit` in a transaction of its own, for requests whose effect is not in the database (reads, shard
        files); a retry of those is harmless, so none of them stores an answer."""
        self.store.write(lambda tx: admit(tx, req), durable=False)

    def keep_nonce(self, req: Signed) -> None:
        """Record the nonce of a request that was refused (its transaction, nonce included, rolled back)."""
        self.store.write(lambda tx: record_nonce(tx, req.signer, req.env.nonce, req.env.timestamp), durable=False)
