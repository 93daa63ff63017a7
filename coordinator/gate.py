"""The one door every signed request comes through, before any rule of the coordinator sees it.

Three steps, so that a request's body is neither read nor parsed for anyone who cannot sign, and the request's
effect, its nonce and its stored answer commit together:

1. `Gate.check_header` (no body, no database; microseconds, on the event loop): the `SIGNATURE_HEADER` is there
   and well formed (401/400), of the endpoint's kind and this pool, by an operator key for operator endpoints
   (403), inside the clock window, with a valid signature over the header (401); a nonce this process saw in the
   window is refused (409) before it costs its signer anything (a captured request replayed cannot spend an honest
   node's rate limit), unless the request carries an Idempotency-Key: the exact bytes of a request sent again may
   be a retry of one already answered, which step 3 tells apart (stored answer or 409), still free for its signer
   but charged to the source that sent it (`rate_limits.resend_rate_per_s`: clients sign each try afresh, so only
   a captured request comes back byte for byte, and its stored answer costs many times what sending it did);
   then the signer's rate limit (429, operators exempt).
2. `Gate.open` (with the body, no database for a node already seen): its sha256 must be the signed one (401); a
   node endpoint's signer must be a node (403: checked once per identity and process before anything of its body
   is parsed, so that a key that is no node never costs a parse); the payload is parsed once into the endpoint's
   model (422: every integer bounded, so nothing oversized reaches the database); a well-formed Idempotency-Key
   (422).
3. `admit`, the first thing the transaction of the request's effect does: an earlier try's stored answer is
   answered again (`coordinator.idempotency`), and a nonce seen before from this signer, in any process, is
   refused (409). Being in that transaction, the nonce commits with the effect, in one commit. A refused request
   rolls its transaction back, nonce included; `Gate.keep_nonce` then records the nonce on its own (the one change
   a refused request makes), so that it cannot be replayed either. Whether the node is registered and unbanned at
   that moment is the endpoint's rule, right after `admit` (`coordinator.registry.require_node`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel

from swarmrl.coordinator.auth import Refused, Replayed, Signed, typed_payload
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.store import Store, Tx
from swarmrl.coordinator.idempotency import (
    Answered,
    check_key,
    previous_answer,
    record_nonce_and_find_answer,
    request_digest,
)
from swarmrl.coordinator.nonces import record_nonce
from swarmrl.coordinator.ratelimit import Buckets
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.protocol.signing import Signature, SignatureError, check_body, parse_header, verify

T = TypeVar("T", bound=BaseModel)

RECENT_NONCES = 100_000
KNOWN_NODES = 100_000


def admit(tx: Tx, req: Signed) -> None:
    """The start of every signed request's transaction: `Answered` with the stored answer when this is a retry of a
    request already applied, Refused(422) for an Idempotency-Key reused for another request, Replayed (409) for a
    nonce seen before; otherwise the nonce is recorded (committed with the request's effect)."""
    if tx.dialect.name == "postgresql":  # one round trip for both
        recorded, earlier = record_nonce_and_find_answer(tx, req)
    else:
        earlier, recorded = previous_answer(tx, req), None
    if earlier is not None:
        raise Answered(earlier)
    if recorded is None:
        recorded = record_nonce(tx, req.signer, req.sig.nonce, req.sig.ts)
    if not recorded:
        raise Replayed()


class Gate:
    """Authenticates signed requests for the pool `pool` against `config` (clock window, operator keys, rate
    limits). `require_node(node_id)` raises Refused(403) unless the node is registered and not banned (a read of
    the store, wired by `coordinator.service`)."""

    def __init__(self, store: Store, config: CoordinatorConfig, clock: Callable[[], float], pool: str,
                 require_node: Callable[[str], object], monotonic: Callable[[], float] = time.monotonic):
        self.store, self.config, self.clock, self.pool = store, config, clock, pool
        self._require_node = require_node
        self._operators = frozenset(k.lower() for k in config.operator_keys)
        limits = config.rate_limits
        self.identities = Buckets(limits.identity_rate_per_s, limits.identity_burst, limits.max_tracked, monotonic)
        self.resends = Buckets(limits.resend_rate_per_s, limits.resend_burst, limits.max_tracked, monotonic)
        self._recent: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._nodes: OrderedDict[str, None] = OrderedDict()  # signers seen to be nodes (a ban is checked later)
        self._lock = threading.Lock()

    def is_operator(self, key: str) -> bool:
        return key.lower() in self._operators

    def check_header(self, header: str | None, kind: str, role: str | None = None, keyed: bool = False,
                     source: str = "") -> Signature:
        """Step 1 (module docstring): the verified signature header of a `kind` request from `source`, or Refused.
        `keyed`: the request carries an Idempotency-Key."""
        try:
            sig = parse_header(header)
        except SignatureError as e:
            raise Refused(e.code, e.reason) from None
        operator = self.is_operator(sig.key)
        if role == "operator" and not operator:
            raise Refused(RefusalCode.NOT_OPERATOR, "this key is not an operator key")
        try:
            verify(sig, kind=kind, pool=self.pool, now=self.clock(), max_skew_s=self.config.clock_skew_s)
        except SignatureError as e:
            raise Refused(e.code, e.reason) from None
        with self._lock:
            if (sig.key, sig.nonce) in self._recent:
                if keyed:  # maybe a retry of an answered request: `admit` decides; its source pays, not its signer
                    wait = self.resends.take(source)
                    if wait > 0:
                        raise Refused(RefusalCode.RATE_LIMITED, "too many signed requests sent again byte for byte "
                                      f"from this address: retry in {wait:.2f} s", retry_after=wait)
                    return sig
                raise Replayed()
            self._recent[(sig.key, sig.nonce)] = None
            if len(self._recent) > RECENT_NONCES:
                self._recent.popitem(last=False)
        if not operator:
            wait = self.identities.take(sig.key)
            if wait > 0:
                raise Refused(RefusalCode.RATE_LIMITED, f"too many requests from this identity: retry in {wait:.2f} s",
                              retry_after=wait)
        return sig

    def open(self, sig: Signature, body: bytes, model: type[T] | None, role: str | None = None,
             idempotency_key: str | None = None, source: str = "") -> Signed:
        """Step 2 (module docstring): the request with its typed payload (`body` itself when `model` is None).
        `idempotency_key`: the request's Idempotency-Key header, for endpoints that store their answers; `source`:
        where it came from (`coordinator.ratelimit.source_of`)."""
        try:
            check_body(sig, body)
        except SignatureError as e:
            raise Refused(e.code, e.reason) from None
        signer = sig.signer_id
        if role == "node" and signer not in self._nodes:
            self._require_node(signer)  # before the parse: an identity that is not a node never costs us one
            with self._lock:
                self._nodes[signer] = None
                if len(self._nodes) > KNOWN_NODES:
                    self._nodes.popitem(last=False)
        payload = body if model is None else typed_payload(body, model)
        key = check_key(idempotency_key)
        return Signed(sig, payload, key, request_digest(sig.kind, sig.body) if key is not None else "", source)

    def knows_node(self, signer: str) -> bool:
        """Whether `open` takes `signer` for a node without reading the store (seen to be one lately)."""
        return signer in self._nodes

    def admit_alone(self, req: Signed) -> None:
        """`admit` in a transaction of its own, for requests whose effect is not in the database (reads, shard
        files); a retry of those is harmless, so none of them stores an answer."""
        self.store.write(lambda tx: admit(tx, req), durable=False)

    def keep_nonce(self, req: Signed) -> None:
        """Record the nonce of a request that was refused (its transaction, nonce included, rolled back)."""
        self.store.write(lambda tx: record_nonce(tx, req.signer, req.sig.nonce, req.sig.ts), durable=False)
