"""Refusals, and what an authenticated request looks like once `coordinator.gate` has opened it.

Checks run in a fixed order, each with its own status, so that a node operator can tell what went wrong: a
missing, malformed or invalid signature (400/401: shape, kind, pool, key, clock window, then the signature over
the header), a rate limit (429 with Retry-After), a body that is not the signed one (401), a replayed nonce (409),
a role the signer does not have (403), a payload that does not fit its schema (422). Nothing parses a body before
its signature, its digest and its signer's role have been checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from swarmrl.coordinator.db.rows import NodeRow
from swarmrl.protocol.signing import Signature

T = TypeVar("T", bound=BaseModel)


class Refused(Exception):
    """A request the coordinator refuses: `status` is the HTTP status, `reason` says why, and `retry_after` (for a
    429) how many seconds to wait before trying again."""

    def __init__(self, status: int, reason: str, retry_after: float | None = None):
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason
        self.retry_after = retry_after


@dataclass(frozen=True)
class Signed:
    """An authenticated request: its signature header, typed payload (the raw body for byte endpoints) and, for
    node endpoints, the node's row."""

    sig: Signature
    payload: Any
    node: NodeRow | None = None

    @property
    def signer(self) -> str:
        return self.sig.signer_id

    @property
    def public_key(self) -> str:
        return self.sig.key


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


def typed_payload(body: bytes, model: type[T]) -> T:
    """The body parsed as `model` (one pass, no re-encoding), or Refused(422) with pydantic's reason."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise Refused(422, describe_validation_error(e)) from None
