"""Signatures: every signed thing in a pool, whoever signs it, is signed by `sign` and checked by `verify`.

A signature covers a small header and the sha256 of a body of bytes:

    DOMAIN + canonical_json({"v", "kind", "pool", "key", "nonce", "ts", "body": sha256(body)})

- `kind` names the message (an endpoint's request, a lease, the run description): one cannot pass for another;
- `pool` names the pool it belongs to, `pool_id(run_id, coordinator_key, epoch)`: a message signed for one pool (or
  for one coordinator key, or one store) is refused by every other, so it cannot be replayed elsewhere;
- `key` is the signer's Ed25519 public key (the node id derives from it), `nonce` 16 random bytes and `ts` the
  signer's clock (0 for timeless things, such as the run description);
- `body` is the sha256 of the exact bytes sent: a request's raw HTTP body, or the canonical JSON of what the
  coordinator signs (a lease, the run description).

Requests carry the header (`Signature`, as compact JSON) in the HTTP header `SIGNATURE_HEADER` and their payload
as the body, in whatever JSON the sender wrote. A receiver therefore checks, without parsing or re-encoding the
body: the header's shape, kind, pool and clock window, then the signature over the header alone (one Ed25519
verify), and only then reads the body, compares its sha256 with the signed one (`check_body`) and parses it.
An unsigned, forged, misdirected or stale request costs the receiver microseconds whatever its size; a replayed
one is refused on its nonce (the receiver remembers those).

The coordinator's answers to operators (verifiers, the trainer) are signed too, in the answer's
`SIGNATURE_HEADER`: kind `answer_kind(request kind)`, and the request's own nonce, so that an answer passes only
for the request it answers (`verify_answer`). Whoever sits on an operator's link can then neither rewrite what a
verifier judges (and get an honest node banned) nor what the trainer trains on, nor replay an old answer.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarmrl.protocol import PROTOCOL_VERSION
from swarmrl.protocol.identity import Identity, node_id_from_public_key, verify_signature
from swarmrl.protocol.pydantic_errors import describe_validation_error
from swarmrl.protocol.refusals import RefusalCode

DEFAULT_CLOCK_SKEW_S = 120.0
SIGNATURE_HEADER = "x-swarmrl-signature"
"""The HTTP header a signed request's `Signature` travels in (compact JSON)."""
PAYLOAD_HEADER = "x-swarmrl-payload"
"""A signed request without a body (a GET): the header its payload (JSON, signed as the body) travels in."""
DOMAIN = b"swarmrl-signed\n"
MAX_RUN_ID = 128
MAX_HEADER_CHARS = 1024
"""A signature header longer than this is malformed: refused before it is parsed."""


class SignatureError(Exception):
    """A signature failed verification; `code` says why for programs (the coordinator refuses with it), `reason` in
    words a node operator can act on."""

    def __init__(self, code: RefusalCode, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, no spaces, ASCII, finite floats only (ValueError otherwise).

    Python writes the shortest repr that round-trips a float, so an object parsed from the wire and encoded
    again gives the same bytes its signer encoded.
    """
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    except ValueError as e:  # allow_nan=False refuses NaN and the infinities
        raise ValueError(f"non-finite numbers cannot be signed ({e})") from None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pool_id(run_id: str, coordinator_key: str, epoch: int = 0) -> str:
    """The name every signature of a pool carries: its run id, its coordinator's public key, and the epoch of its
    store (drawn when the store was made: a fresh store under the same key and run id is another pool, so what was
    signed for the old one is refused by it; 0: none, for things signed outside any store)."""
    base = f"{run_id}/{coordinator_key.lower()}"
    return f"{base}/{epoch:016x}" if epoch else base


_HEX64 = r"^[0-9a-f]{64}$"


class Signature(BaseModel):
    """A signature header: what was signed (kind, pool, body digest), by whom, when, and the Ed25519 signature."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: str = Field(max_length=16, description="Protocol version of the signer.")
    kind: str = Field(max_length=64, description="Message type; the receiver checks it is the one it expects.")
    pool: str = Field(max_length=MAX_RUN_ID + 82, description="`pool_id(run_id, coordinator_key, epoch)` of the "
                      "pool.")
    key: str = Field(pattern=_HEX64, description="Signer's Ed25519 public key, lower-case hex.")
    nonce: str = Field(pattern=r"^[0-9a-f]{32}$", description="16 random bytes, hex; never reused by a signer.")
    ts: float = Field(ge=0, le=1e11, description="Signer's clock, unix seconds (0: timeless).")
    body: str = Field(pattern=_HEX64, description="sha256 of the signed body bytes, hex.")
    sig: str = Field(pattern=r"^[0-9a-f]{128}$", description="Ed25519 signature of `signed_bytes()`, hex.")

    @property
    def signer_id(self) -> str:
        return node_id_from_public_key(self.key)

    def signed_bytes(self) -> bytes:
        return _message(self.kind, self.pool, self.key, self.nonce, self.ts, self.body)

    def header(self) -> str:
        """As sent in `SIGNATURE_HEADER`."""
        return self.model_dump_json()


def time_ordered_id(now: float, random_digits: int) -> str:
    """An id that nobody can guess and that sorts by when it was made: `now` in milliseconds as 11 hex digits, then
    `random_digits` random hex digits (4 bits each). Ids made together sit together in an index keyed by them, so
    storing a new one writes to the page the ones before it went to, not to one picked at random."""
    return f"{max(int(now * 1000), 0):011x}{secrets.randbits(4 * random_digits):0{random_digits}x}"


def _message(kind: str, pool: str, key: str, nonce: str, ts: float, body: str) -> bytes:
    return DOMAIN + canonical_json({"v": PROTOCOL_VERSION, "kind": kind, "pool": pool, "key": key, "nonce": nonce,
                                    "ts": ts, "body": body})


def sign(identity: Identity, kind: str, pool: str, body: bytes, *, ts: float | None = None,
         nonce: str | None = None) -> Signature:
    """Sign `body` as a `kind` message of `pool`: the one signing function of every role and the coordinator.

    `ts` defaults to now and `nonce` to a fresh random one; things signed once for good (the run description)
    pass ts=0 and a nonce derived from what they sign, so that signing them again gives the same signature."""
    ts = round(time.time(), 3) if ts is None else ts
    nonce = secrets.token_hex(16) if nonce is None else nonce
    digest, key = sha256_hex(body), identity.public_key_hex
    return Signature(v=PROTOCOL_VERSION, kind=kind, pool=pool, key=key, nonce=nonce, ts=ts, body=digest,
                     sig=identity.sign(_message(kind, pool, key, nonce, ts, digest)))


def parse_header(text: str | None) -> Signature:
    """The `Signature` in a request header, or SignatureError saying what is wrong with it (never a large parse:
    an over-long header is refused unread)."""
    if text is None:
        raise SignatureError(RefusalCode.UNSIGNED, f"unsigned request: the {SIGNATURE_HEADER} header is missing")
    if len(text) > MAX_HEADER_CHARS:
        raise SignatureError(RefusalCode.MALFORMED_SIGNATURE,
                             f"malformed {SIGNATURE_HEADER} header: longer than {MAX_HEADER_CHARS} characters")
    try:
        return Signature.model_validate_json(text)
    except ValidationError as e:
        where = describe_validation_error(e, limit=3, root="header")
        raise SignatureError(RefusalCode.MALFORMED_SIGNATURE, f"malformed {SIGNATURE_HEADER} header: {where}") from None


def verify(sig: Signature, *, kind: str, pool: str, key: str | None = None, now: float | None = None,
           max_skew_s: float | None = DEFAULT_CLOCK_SKEW_S) -> None:
    """Raise SignatureError unless `sig` is a valid signature of a `kind` message of `pool` (by `key`, when given)
    made within `max_skew_s` of `now` (None: any time, for timeless things). The body is `check_body`'s.

    Replay protection needs state: a receiver of requests must also check that (signer, nonce) is new."""
    if sig.kind != kind:
        raise SignatureError(RefusalCode.WRONG_KIND, f"expected a {kind!r} message, got {sig.kind!r}")
    if sig.pool != pool:
        raise SignatureError(RefusalCode.OTHER_POOL,
                             f"signed for another pool ({sig.pool[:80]!r}), not this one ({pool[:80]!r})")
    if key is not None and sig.key != key.lower():
        raise SignatureError(RefusalCode.WRONG_KEY, f"signed by {sig.key[:16]}…, not by the expected key {key[:16]}…")
    if sig.v != PROTOCOL_VERSION:
        raise SignatureError(RefusalCode.PROTOCOL_VERSION,
                             f"protocol version {sig.v!r}; this side speaks {PROTOCOL_VERSION!r}")
    if not verify_signature(sig.key, sig.signed_bytes(), sig.sig):
        raise SignatureError(RefusalCode.BAD_SIGNATURE, "bad signature")
    if max_skew_s is not None:
        now = time.time() if now is None else now
        if abs(now - sig.ts) > max_skew_s:
            raise SignatureError(RefusalCode.CLOCK_SKEW,
                                 f"stale or future timestamp ({now - sig.ts:+.0f} s from the receiver's clock)")


def check_body(sig: Signature, body: bytes) -> None:
    """SignatureError unless `body` is the body `sig` was made for."""
    if sha256_hex(body) != sig.body:
        raise SignatureError(RefusalCode.BODY_NOT_SIGNED, "the body is not the one signed (its sha256 differs)")


def verify_signed(sig: Signature, body: bytes, **kw: Any) -> None:
    """`verify(sig, **kw)` then `check_body(sig, body)`."""
    verify(sig, **kw)
    check_body(sig, body)


def answer_kind(kind: str) -> str:
    """The kind the coordinator signs its answer to a `kind` request with."""
    return f"{kind}.answer"


def verify_answer(header: str | None, body: bytes, *, request: str, key: str) -> None:
    """SignatureError unless `header` is the coordinator's (`key`) signature of `body` as its answer to the request
    whose signature header is `request` (the same pool, the kind's answer, the request's nonce: an answer to
    another request, or an old one, is refused)."""
    asked = parse_header(request)
    sig = parse_header(header)
    verify_signed(sig, body, kind=answer_kind(asked.kind), pool=asked.pool, key=key, max_skew_s=None)
    if sig.nonce != asked.nonce:
        raise SignatureError(RefusalCode.REPLAYED, "the answer was signed for another request (its nonce differs)")
