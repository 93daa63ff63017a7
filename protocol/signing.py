"""Signed envelopes: every request a key holder makes is signed over a canonical byte encoding.

The signed bytes bind the protocol version, the message type, the signer's key, a random nonce, a
timestamp and the payload. The receiver checks, in this order: the signature, the timestamp window, and
(with its own store) that the nonce was not seen before. A tampered, forged, replayed or stale envelope
is therefore refused before its payload is looked at.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from pydantic import BaseModel, Field

from swarmrl.protocol import PROTOCOL_VERSION
from swarmrl.protocol.identity import Identity, node_id_from_public_key, verify_signature

DEFAULT_CLOCK_SKEW_S = 120.0


class SignatureError(Exception):
    """An envelope failed verification; `reason` says why in words a node operator can act on."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, no spaces, ASCII, finite floats only (ValueError otherwise).

    Python writes the shortest repr that round-trips a float, so a payload parsed from the wire and
    encoded again gives the same bytes the sender signed.
    """
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    except ValueError as e:  # allow_nan=False refuses NaN and the infinities
        raise ValueError(f"non-finite numbers cannot be signed ({e})") from None


class SignedEnvelope(BaseModel):
    """A typed payload with its signer, nonce, timestamp and Ed25519 signature."""

    kind: str = Field(max_length=64, description="Message type; the receiver checks it matches the endpoint.")
    public_key: str = Field(min_length=64, max_length=64, description="Signer's Ed25519 public key, hex.")
    nonce: str = Field(min_length=32, max_length=32, description="16 random bytes, hex; never reused.")
    timestamp: float = Field(description="Signer's clock, unix seconds; must be within the receiver's window.")
    payload: dict[str, Any] = Field(description="The message itself, as plain JSON.")
    signature: str = Field(min_length=128, max_length=128, description="Ed25519 signature, hex.")

    @property
    def signer_id(self) -> str:
        return node_id_from_public_key(self.public_key)

    def signed_bytes(self) -> bytes:
        return _signed_bytes(self.kind, self.public_key, self.nonce, self.timestamp, self.payload)


def _signed_bytes(kind: str, public_key: str, nonce: str, timestamp: float, payload: dict[str, Any]) -> bytes:
    return signed_message(kind, public_key, nonce, timestamp, canonical_json(payload))


def signed_message(kind: str, public_key: str, nonce: str, timestamp: float, payload_json: bytes) -> bytes:
    """The bytes an envelope's signature covers, from the payload's canonical JSON (`canonical_json(payload)`).

    The same as canonical_json({"header": ..., "payload": payload}): keys sort "header" before "payload", so
    the canonical payload bytes are spliced in as they are, and nobody encodes a large payload twice."""
    header = {"v": PROTOCOL_VERSION, "kind": kind, "key": public_key, "nonce": nonce, "ts": timestamp}
    return b'{"header":' + canonical_json(header) + b',"payload":' + payload_json + b"}"


def sign(identity: Identity, kind: str, payload: BaseModel | dict[str, Any]) -> SignedEnvelope:
    """Wrap `payload` in an envelope signed by `identity` with a fresh nonce and the current time."""
    body = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    # Round-trip through JSON so that what we sign is exactly what the receiver will parse.
    body = json.loads(canonical_json(body))
    nonce = secrets.token_hex(16)
    ts = round(time.time(), 3)
    sig = identity.sign(_signed_bytes(kind, identity.public_key_hex, nonce, ts, body))
    return SignedEnvelope(
        kind=kind, public_key=identity.public_key_hex, nonce=nonce, timestamp=ts, payload=body, signature=sig
    )


def signed_body(identity: Identity, kind: str, payload: BaseModel | dict[str, Any]) -> bytes:
    """What `sign(identity, kind, payload).model_dump_json()` sends, made with one encoding of the payload: the
    canonical payload bytes are both signed and sent, so the receiver parses exactly what was signed."""
    body = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    return signed_body_of_json(identity, kind, canonical_json(body))


def signed_body_of_json(identity: Identity, kind: str, payload_json: bytes) -> bytes:
    """`signed_body` for a payload given as its canonical JSON (`canonical_json(payload)`, or bytes equal to it:
    the signature covers exactly these bytes, and a receiver encodes what it parses canonically again)."""
    key = identity.public_key_hex
    nonce = secrets.token_hex(16)
    ts = round(time.time(), 3)
    sig = identity.sign(signed_message(kind, key, nonce, ts, payload_json))
    head = json.dumps({"kind": kind, "public_key": key, "nonce": nonce, "timestamp": ts}, ensure_ascii=True)
    return head[:-1].encode() + _PAYLOAD_MARK + payload_json + _SIGNATURE_MARK + sig.encode() + b'"}'


_PAYLOAD_MARK = b', "payload": '
_SIGNATURE_MARK = b', "signature": "'
_TAIL = len(_SIGNATURE_MARK) + 128 + 2


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _as_sent(raw: bytes) -> tuple[SignedEnvelope, bytes] | None:
    """The envelope in a body laid out as `signed_body` writes it, with the payload's bytes as sent; None for any
    other layout (or anything malformed: the general path then says what)."""
    if len(raw) < _TAIL or not raw.endswith(b'"}') or raw[-_TAIL:-_TAIL + len(_SIGNATURE_MARK)] != _SIGNATURE_MARK:
        return None
    at = raw.find(_PAYLOAD_MARK)
    if at < 0:
        return None
    payload_json = raw[at + len(_PAYLOAD_MARK):-_TAIL]
    try:
        head = json.loads(raw[:at] + b"}")
        payload = json.loads(payload_json, parse_constant=_refuse_constant)
        if not isinstance(head, dict) or set(head) != {"kind", "public_key", "nonce", "timestamp"}:
            return None
        env = SignedEnvelope.model_validate({**head, "payload": payload,
                                             "signature": raw[-_TAIL + len(_SIGNATURE_MARK):-2].decode()})
    except ValueError:  # malformed JSON or fields (pydantic's ValidationError is a ValueError)
        return None
    return env, payload_json


def open_signed(raw: bytes, *, kind: str, now: float | None = None, max_skew_s: float = DEFAULT_CLOCK_SKEW_S
                ) -> tuple[SignedEnvelope, bytes]:
    """Parse a request body holding an envelope and `verify` it; the envelope and the payload JSON that was signed.

    Raises pydantic's ValidationError for a malformed envelope, SignatureError as `verify` does. A body as
    `signed_body` writes it is checked against its payload bytes as sent, which were signed: the payload is
    parsed from exactly those bytes, and no large payload is encoded again (the canonical encoding is the
    receiver's largest cost per request). Any other body, or one whose bytes as sent do not carry the signature
    (a sender that encoded its payload some other way), is checked the general way.
    """
    sent = _as_sent(raw)
    if sent is not None:
        env, payload_json = sent
        message = signed_message(env.kind, env.public_key, env.nonce, env.timestamp, payload_json)
        if env.kind == kind and verify_signature(env.public_key, message, env.signature):
            _check_clock(env, now, max_skew_s)
            return env, payload_json
    env = SignedEnvelope.model_validate_json(raw)
    return env, verify(env, kind=kind, now=now, max_skew_s=max_skew_s)


def verify(
    env: SignedEnvelope,
    *,
    kind: str,
    now: float | None = None,
    max_skew_s: float = DEFAULT_CLOCK_SKEW_S,
) -> bytes:
    """Raise SignatureError unless `env` is a valid signature of a `kind` message made within the window; return
    the payload's canonical JSON (what was signed: a receiver can hash it instead of encoding it again).

    Replay protection needs state: the caller must also check that (signer, nonce) is new.
    """
    if env.kind != kind:
        raise SignatureError(f"expected a {kind!r} message, got {env.kind!r}")
    try:
        payload_json = canonical_json(env.payload)
    except ValueError as e:
        raise SignatureError(f"payload cannot be encoded canonically: {e}") from e
    message = signed_message(env.kind, env.public_key, env.nonce, env.timestamp, payload_json)
    if not verify_signature(env.public_key, message, env.signature):
        raise SignatureError("bad signature")
    _check_clock(env, now, max_skew_s)
    return payload_json


def _check_clock(env: SignedEnvelope, now: float | None, max_skew_s: float) -> None:
    now = time.time() if now is None else now
    if abs(now - env.timestamp) > max_skew_s:
        raise SignatureError(f"stale or future timestamp ({now - env.timestamp:+.0f} s from the receiver's clock)")
