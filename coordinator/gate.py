"""The one door every signed request comes through, before any rule of the coordinator sees it.

Two steps, so that a request's body is neither read nor parsed for anyone who cannot sign:

1. `check_header` (no body, no database; microseconds): the `SIGNATURE_HEADER` is there and well formed (401/400),
   of the endpoint's kind and this pool, by an operator key for operator endpoints (403), inside the clock window,
   with a valid signature over the header (401); a nonce this process saw in the window is refused (409) before it
   costs its signer anything; then the signer's rate limit (429, operators exempt).
2. `admit` (with the body): its sha256 must be the signed one (401), the nonce is recorded (409 if already seen,
   in any process), a node endpoint's signer must be a registered, unbanned node (403), and only then is the
   payload parsed, once, into the endpoint's model (422).

The nonce is committed in a transaction of its own, before the payload is looked at: even a request refused later
cannot be replayed.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel

from swarmrl.coordinator.auth import Refused, Signed, typed_payload
from swarmrl.coordinator.config import CoordinatorConfig
from swarmrl.coordinator.db.rows import NodeRow
from swarmrl.coordinator.db.store import Store, Tx
from swarmrl.coordinator.nonces import prune_nonces, record_nonce
from swarmrl.coordinator.ratelimit import Buckets
from swarmrl.coordinator.registry import active, get_node
from swarmrl.protocol.signing import Signature, SignatureError, check_body, parse_header, verify

T = TypeVar("T", bound=BaseModel)

PRUNE_EVERY_S = 10.0
RECENT_NONCES = 100_000

class Gate:
    """Authenticates signed requests for the pool `pool` against `config` (clock window, operator keys, rate
    limits) and the store (nonces, nodes)."""

    def __init__(self, store: Store, config: CoordinatorConfig, clock: Callable[[], float], pool: str,
                 monotonic: Callable[[], float] = time.monotonic):
        self.store, self.config, self.clock, self.pool = store, config, clock, pool
        self._operators = frozenset(k.lower() for k in config.operator_keys)
        limits = config.rate_limits
        self.identities = Buckets(limits.identity_rate_per_s, limits.identity_burst, limits.max_tracked, monotonic)
        self._recent: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._recent_lock = threading.Lock()
        self._last_prune = 0.0

    def is_operator(self, key: str) -> bool:
        return key.lower() in self._operators

    def check_header(self, header: str | None, kind: str, role: str | None = None) -> Signature:
        """Step 1 (module docstring): the verified signature header of a `kind` request, or Refused."""
        try:
            sig = parse_header(header)
        except SignatureError as e:
            raise Refused(401 if header is None else 400, e.reason) from None
        operator = self.is_operator(sig.key)
        if role == "operator" and not operator:
            raise Refused(403, "this key is not an operator key")
        try:
            verify(sig, kind=kind, pool=self.pool, now=self.clock(), max_skew_s=self.config.clock_skew_s)
        except SignatureError as e:
            raise Refused(401, e.reason) from None
        with self._recent_lock:
            if (sig.key, sig.nonce) in self._recent:
                raise Refused(409, "replayed request")
            self._recent[(sig.key, sig.nonce)] = None
            if len(self._recent) > RECENT_NONCES:
                self._recent.popitem(last=False)
        if not operator:
            wait = self.identities.take(sig.key)
            if wait > 0:
                raise Refused(429, f"too many requests from this identity: retry in {wait:.2f} s", retry_after=wait)
        return sig

    def admit(self, sig: Signature, body: bytes, model: type[T] | None, role: str | None = None) -> Signed:
        """Step 2 (module docstring): the request with its typed payload (`body` itself when `model` is None)."""
        try:
            check_body(sig, body)
        except SignatureError as e:
            raise Refused(401, e.reason) from None
        now = self.clock()
        signer = sig.signer_id

        def remember(tx: Tx) -> tuple[bool, NodeRow | None]:
            if now - self._last_prune > PRUNE_EVERY_S:
                # A nonce only needs remembering while its timestamp is inside the window; 2x for margin.
                self._last_prune = now
                prune_nonces(tx, now - 2 * self.config.clock_skew_s)
            new = record_nonce(tx, signer, sig.nonce, sig.ts)
            return new, get_node(tx, signer) if new and role == "node" else None  # read now, judged below

        new, node = self.store.write(remember, durable=False)  # see coordinator.db.store on why this may be lost
        if not new:
            raise Refused(409, "replayed request")
        if role == "node":
            node = active(node)  # before the parse: an identity that is not a node never costs us one
        payload = body if model is None else typed_payload(body, model)
        return Signed(sig, payload, node)

    def open(self, header: str | None, body: bytes, kind: str, model: type[T] | None, role: str | None = None
             ) -> Signed:
        """Both steps, for a request whose body is at hand."""
        return self.admit(self.check_header(header, kind, role), body, model, role)
