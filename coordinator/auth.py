"""Opening signed requests: envelope parsing, signature and clock checks, payload typing (no state: the replay
check and the roles are `coordinator.gate`'s).

Checks run in a fixed order, each with its own status, so that a node operator can tell what went wrong:
malformed envelope (422), bad signature or stale timestamp (401), replayed nonce (409), payload that
does not fit its schema (422). Nothing here looks at the payload before the signature has been checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from swarmrl.protocol.signing import SignatureError, SignedEnvelope, open_signed

T = TypeVar("T", bound=BaseModel)


class Refused(Exception):
    """A request the coordinator refuses: `status` is the HTTP status, `reason` says why."""

    def __init__(self, status: int, reason: str, headers: dict[str, str] | None = None):
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason
        self.headers = headers or {}


class Replayed(Refused):
    """A nonce this signer used before (409)."""

    def __init__(self) -> None:
        super().__init__(409, "replayed request")


@dataclass(frozen=True)
class Signed:
    """An authenticated request: its envelope, typed payload, and (when the client sent one for an endpoint that
    stores answers) its Idempotency-Key with the digest that identifies the request across retries."""

    env: SignedEnvelope
    payload: Any
    idempotency_key: str | None = None
    digest: str = ""
    signer: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "signer", self.env.signer_id)  # a hash: computed once


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


def open_envelope(raw: bytes | str, kind: str, now: float, max_skew_s: float) -> tuple[SignedEnvelope, bytes]:
    """The envelope in `raw` and the payload JSON it signs (`protocol.signing.open_signed`); Refused(422) saying why
    it is malformed, Refused(401) unless it is a valid `kind` message signed within the clock window."""
    try:
        return open_signed(raw.encode() if isinstance(raw, str) else raw, kind=kind, now=now, max_skew_s=max_skew_s)
    except ValidationError as e:
        raise Refused(422, f"malformed envelope: {describe_validation_error(e)}") from None
    except SignatureError as e:
        raise Refused(401, e.reason) from None


def typed_payload(env: SignedEnvelope, model: type[T]) -> T:
    """The envelope's payload as `model`, or Refused(422) with pydantic's reason."""
    try:
        return model.model_validate(env.payload)
    except ValidationError as e:
        raise Refused(422, describe_validation_error(e)) from None
