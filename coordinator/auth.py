"""Refusals, and what an authenticated request looks like once `coordinator.gate` has opened it.

Checks run in a fixed order, each with its own status, so that a node operator can tell what went wrong: a
missing, malformed or invalid signature (400/401: shape, kind, pool, key, clock window, then the signature over
the header), a rate limit (429 with Retry-After), a body that is not the signed one (401), a role the signer does
not have (403), a payload that does not fit its schema (422), a malformed Idempotency-Key (422); then, in the
transaction of the request's effect, a replayed nonce (409). Nothing parses a body before its signature, its
digest and its signer's role have been checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from swarmrl.coordinator.ratelimit import retry_after_header
from swarmrl.protocol.pydantic_errors import describe_validation_error
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.protocol.signing import Signature

T = TypeVar("T", bound=BaseModel)


class Refused(Exception):
    """A request the coordinator refuses: `code` says why for programs (`protocol.refusals`; it fixes the HTTP
    `status`), `reason` for people, `headers` go with the answer; `retry_after` (seconds, for a 429 or a full lease
    book) adds a Retry-After header. A refusal cannot be made without its code."""

    def __init__(self, code: RefusalCode, reason: str, headers: dict[str, str] | None = None,
                 retry_after: float | None = None):
        if not isinstance(code, RefusalCode):
            raise TypeError(f"a refusal needs its RefusalCode, got {code!r}")
        super().__init__(f"{code.status} {code}: {reason}")
        self.code = code
        self.status = code.status
        self.reason = reason
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers["Retry-After"] = retry_after_header(retry_after).decode()


class Replayed(Refused):
    """A nonce this signer used before (409)."""

    def __init__(self) -> None:
        super().__init__(RefusalCode.REPLAYED, "replayed request")


class StaleSubmission(Refused):
    """A submission against a policy version too old to train on (409): nothing of it is taken, and its lease is
    settled (`coordinator.leases`)."""

    def __init__(self, reason: str):
        super().__init__(RefusalCode.STALE_SUBMISSION, f"stale submission, against the current version: {reason}")


@dataclass(frozen=True)
class Signed:
    """An authenticated request: its signature header, typed payload (the raw body for byte endpoints), and (when
    the client sent one for an endpoint that stores answers) its Idempotency-Key with the digest that identifies
    the request across retries, and its source."""

    sig: Signature
    payload: Any
    idempotency_key: str | None = None
    digest: str = ""
    source: str = ""
    """Where the request came from, as the rate limits see it (`coordinator.ratelimit.source_of`)."""
    signer: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "signer", self.sig.signer_id)  # a hash: computed once

    @property
    def public_key(self) -> str:
        return self.sig.key

    def to_wire(self) -> list[Any]:
        """What a write in another process reads of this request (`coordinator.db.sqlite.writer`): its signature header,
        Idempotency-Key, digest and source, as plain data; not its payload."""
        return [self.sig.header(), self.idempotency_key, self.digest, self.source]

    @classmethod
    def from_wire(cls, wire: list[Any]) -> Signed:
        """The request `to_wire` sent, without its payload (None)."""
        header, key, digest, source = wire
        return cls(Signature.model_validate_json(header), None, key, digest, source)


def typed_payload(body: bytes, model: type[T]) -> T:
    """The body parsed as `model` (one pass, no re-encoding), or Refused(422) with pydantic's reason."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise Refused(RefusalCode.INVALID_PAYLOAD, describe_validation_error(e)) from None
