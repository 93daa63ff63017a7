"""Opening signed requests: envelope parsing, signature and clock checks, payload typing (no state: the replay
check and the roles are `coordinator.gate`'s).

Checks run in a fixed order, each with its own status, so that a node operator can tell what went wrong:
malformed envelope (422), bad signature or stale timestamp (401), replayed nonce (409), payload that
does not fit its schema (422). Nothing here looks at the payload before the signature has been checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from swarmrl.coordinator.db.rows import NodeRow
from swarmrl.protocol.signing import SignatureError, SignedEnvelope, verify

T = TypeVar("T", bound=BaseModel)


class Refused(Exception):
    """A request the coordinator refuses: `status` is the HTTP status, `reason` says why."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Signed:
    """An authenticated request: its envelope, typed payload and (for node endpoints) the node's row."""

    env: SignedEnvelope
    payload: Any
    node: NodeRow | None = None

    @property
    def signer(self) -> str:
        return self.env.signer_id


def describe_validation_error(e: ValidationError, limit: int = 5) -> str:
    """Pydantic's reasons as one line: `loc: message; ...` (input values left out, they may be huge)."""
    parts = []
    for err in e.errors()[:limit]:
        loc = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = len(e.errors()) - limit
    if more > 0:
        parts.append(f"... and {more} more")
    return "; ".join(parts)


def parse_envelope(raw: bytes | str) -> SignedEnvelope:
    """The envelope in `raw`, or Refused(422) saying why it is malformed."""
    try:
        return SignedEnvelope.model_validate_json(raw)
    except ValidationError as e:
        raise Refused(422, f"malformed envelope: {describe_validation_error(e)}") from None


def check_signature(env: SignedEnvelope, kind: str, now: float, max_skew_s: float) -> None:
    """Refused(401) unless `env` is a valid `kind` message signed within the clock window."""
    try:
        verify(env, kind=kind, now=now, max_skew_s=max_skew_s)
    except SignatureError as e:
        raise Refused(401, e.reason) from None


def typed_payload(env: SignedEnvelope, model: type[T]) -> T:
    """The envelope's payload as `model`, or Refused(422) with pydantic's reason."""
    try:
        return model.model_validate(env.payload)
    except ValidationError as e:
        raise Refused(422, describe_validation_error(e)) from None
