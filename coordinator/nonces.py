"""Single-use tokens: the nonces of signed requests and the registration challenges already redeemed.

A (signer, nonce) pair is recorded once, with the timestamp it was signed with; recording it again is refused, in
this process or any other sharing the database. (Records are keyed by that time first, for where they are stored:
`db.schema.nonces`. A replay carries the same timestamp; a signer reusing its own nonce at another time replays
nothing.) A record is needed only while what it guards could still be accepted (a request's timestamp inside the
clock window, a challenge before its expiry), so records older than that are pruned (`coordinator.liveness`).
"""

from __future__ import annotations

from sqlalchemy import delete

from swarmrl.coordinator.db.fast import Prepared
from swarmrl.coordinator.db.schema import nonces
from swarmrl.coordinator.db.store import Tx, insert

_RECORD = {d: Prepared(insert(d, nonces).on_conflict_do_nothing().returning(nonces.c.signer),
                       keys=["signer", "nonce", "ts"]) for d in ("sqlite", "postgresql")}


def record_nonce(tx: Tx, signer: str, nonce: str, ts: float) -> bool:
    """Remember (signer, nonce) with time `ts`; False if it was already recorded with that time (a replay)."""
    return _RECORD[tx.dialect.name].first(tx, signer=signer, nonce=nonce, ts=ts) is not None


def prune_nonces(tx: Tx, older_than: float) -> int:
    """Forget records whose time is older than `older_than`; how many."""
    return tx.execute(delete(nonces).where(nonces.c.ts < older_than)).rowcount
