"""Exactly once under retries: the stored answer of every request that carried an `Idempotency-Key`.

A client sends one random key per logical request and the same key on each retry of it, signed afresh each time
(`runtime.client`). The coordinator stores (signer, key) -> (digest of the request, status, body) in the same
transaction as the request's effect (`remember`), so the two commit together or not at all. A retry whose answer
was lost finds the stored answer before anything else is looked at (`coordinator.gate.admit`) and gets it again,
byte for byte, while the effect is not applied a second time. The same key with a different request (another
kind or payload) is refused (422). Two tries of one request running at once (a client that timed out and retried
while its first try was still being served) are settled by the key's primary key: the second to store its answer
finds the first one's, rolls back its own effect and answers with the first one's answer.

The answers are keyed by (key, signer), the key first: an honest client's keys begin with the time, so the answers
stored in one commit sit side by side in that index. A key is the client's choice; one that does not begin so only
costs that client's own answers a page of their own.

Only answers of requests that changed something are stored (refusals change nothing but the nonce, and are
evaluated again on a retry); keys are kept for `idempotency_ttl_s` (`prune`), long after any client gives up
retrying one request.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from pydantic import BaseModel
from sqlalchemy import Double, and_, bindparam, delete, exists, literal, select, tuple_

from swarmrl.coordinator.auth import Refused, Signed
from swarmrl.coordinator.db.fast import Prepared
from swarmrl.coordinator.db.schema import idempotency_keys, nonces
from swarmrl.coordinator.db.store import Tx, insert
from swarmrl.protocol.refusals import RefusalCode

KEY_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{8,128}$")
"""What an Idempotency-Key may look like (the client sends 27 hex digits, its time first:
`runtime.client.new_idempotency_key`)."""


@dataclass(frozen=True)
class Answer:
    """An answer as it went out: its status and JSON body (empty for 204)."""

    status: int
    body: bytes

    @classmethod
    def of(cls, result: BaseModel | Answer | None) -> Answer:
        """200 with the model as JSON, or 204 for None; an answer made already, as it is."""
        if isinstance(result, Answer):
            return result
        return cls(204, b"") if result is None else cls(200, result.model_dump_json().encode())


class Answered(Exception):
    """The request was answered before (a retry): send `answer` again; nothing else happens."""

    def __init__(self, answer: Answer):
        super().__init__(f"answered before with {answer.status}")
        self.answer = answer


def check_key(key: str | None) -> str | None:
    """`key` if it is a well-formed Idempotency-Key (None stays None); Refused(422) otherwise."""
    if key is not None and not KEY_PATTERN.match(key):
        raise Refused(RefusalCode.MALFORMED_IDEMPOTENCY_KEY,
                      "malformed Idempotency-Key header: 8 to 128 characters of A-Z a-z 0-9 _ . : -")
    return key


def request_digest(kind: str, body_sha256: str) -> str:
    """What makes two tries the same request: the message kind and the sha256 of its body, both signed (the nonce,
    timestamp and signature differ between tries; the client sends the same body bytes on each)."""
    return hashlib.sha256(f"{kind}\n{body_sha256}".encode()).hexdigest()


_k = idempotency_keys.c
_LOOKUP = Prepared(select(_k.digest, _k.status, _k.body).where(_k.signer == bindparam("b_signer"),
                                                                _k.key == bindparam("b_key")))
_STORE = {d: Prepared(insert(d, idempotency_keys).on_conflict_do_nothing().returning(_k.key),
                      keys=["signer", "key", "digest", "status", "body", "created_at"])
          for d in ("sqlite", "postgresql")}


def previous_answer(tx: Tx, req: Signed) -> Answer | None:
    """The stored answer to an earlier try of `req` (None without a key or when there is none); Refused(422) if
    the key was used for a different request."""
    if req.idempotency_key is None:
        return None
    return _answer(req, _LOOKUP.first(tx, b_signer=req.signer, b_key=req.idempotency_key))


# PostgreSQL: the nonce recorded and the stored answer looked up in one statement (one round trip, not two).
_RECORDED = insert("postgresql", nonces).values(
    ts=bindparam("b_ts", type_=Double), signer=bindparam("b_signer"), nonce=bindparam("b_nonce"),
).on_conflict_do_nothing().returning(nonces.c.signer).cte("recorded")
_ONE = select(literal(1).label("one")).subquery("one")
_RECORD_AND_LOOKUP = Prepared(
    select(exists(select(_RECORDED.c.signer)), _k.digest, _k.status, _k.body).select_from(_ONE.outerjoin(
        idempotency_keys, and_(_k.signer == bindparam("b_signer"), _k.key == bindparam("b_key")))))


def record_nonce_and_find_answer(tx: Tx, req: Signed) -> tuple[bool, Answer | None]:
    """On PostgreSQL, `record_nonce` of `req` and `previous_answer` of it, in one statement: (whether its nonce is
    new, the stored answer). Both are changes of `tx` only: an answer found or a replay refused rolls them back."""
    recorded, digest, status, body = _RECORD_AND_LOOKUP.first(
        tx, b_ts=req.sig.ts, b_signer=req.signer, b_nonce=req.sig.nonce, b_key=req.idempotency_key)
    return bool(recorded), _answer(req, None if digest is None else (digest, status, body))


def _answer(req: Signed, row: tuple[str, int, str] | None) -> Answer | None:
    """The answer stored in `row` for an earlier try of `req`; Refused(422) if the key was used for another."""
    if row is None:
        return None
    digest, status, body = row
    if digest != req.digest:
        raise Refused(RefusalCode.IDEMPOTENCY_KEY_REUSED,
                      "this Idempotency-Key was already used for a different request: use a new key per request")
    return Answer(status, body.encode())


def remember(tx: Tx, req: Signed, result: BaseModel | None, now: float) -> None:
    """Store the answer to `req` (when it carries a key) in the transaction that applies its effect. Raises
    `Answered` (rolling that effect back) if a concurrent try of the same request stored its answer first."""
    if req.idempotency_key is None:
        return
    answer = Answer.of(result)
    stored = _STORE[tx.dialect.name].first(tx, signer=req.signer, key=req.idempotency_key, digest=req.digest,
                                           status=answer.status, body=answer.body.decode(), created_at=now)
    if stored is None:
        earlier = previous_answer(tx, req)
        if earlier is None:  # pragma: no cover - the conflicting row is visible once its transaction committed
            raise RuntimeError("an idempotency key conflicted with an answer that cannot be read")
        raise Answered(earlier)


def prune(tx: Tx, older_than: float, limit: int = 5000) -> int:
    """Forget up to `limit` of the oldest answers stored before `older_than`; how many."""
    old = select(_k.signer, _k.key).where(_k.created_at < older_than).order_by(_k.created_at).limit(limit)
    rows = tx.execute(old).all()
    if not rows:
        return 0
    tx.execute(delete(idempotency_keys).where(tuple_(_k.signer, _k.key).in_([tuple(r) for r in rows])))
    return len(rows)
