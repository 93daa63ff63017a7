"""Why the coordinator refuses a request: a code for programs, a reason for people.

Every error answer of the coordinator's API is an `ErrorBody`: `{"detail": reason, "code": code}`. The reason is
written for a node operator and may be reworded at any time; the code is part of the contract, and it is what a
client decides on (register again, stop, wait, retry a registration with a new challenge). Each code has one HTTP
status, so a refusal is made from its code alone (`RefusalCode.status`).

The table of codes with their meaning is in docs/refusals.md (`tests/test_refusal_codes.py` keeps the two equal).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field


class RefusalCode(StrEnum):
    """A refusal's code: its value is what travels; `status` its HTTP status, `meaning` one line for the docs."""

    status: int
    meaning: str

    def __new__(cls, value: str, status: int, meaning: str) -> RefusalCode:
        member = str.__new__(cls, value)
        member._value_ = value
        member.status = status
        member.meaning = meaning
        return member

    # -- the request's signature (protocol.signing) ---------------------------------------------------------
    UNSIGNED = "unsigned", 401, "the signature header is missing"
    MALFORMED_SIGNATURE = "malformed_signature", 400, "the signature header does not parse"
    WRONG_KIND = "wrong_kind", 401, "signed as another kind of message than the endpoint takes"
    OTHER_POOL = "other_pool", 401, "signed for another pool (another run or coordinator key): register again"
    WRONG_KEY = "wrong_key", 401, "signed by another key than the one expected"
    PROTOCOL_VERSION = "protocol_version", 401, "signed under another protocol version"
    BAD_SIGNATURE = "bad_signature", 401, "the signature does not verify"
    CLOCK_SKEW = "clock_skew", 401, "the signature's timestamp is outside the coordinator's clock window: fix the clock"
    BODY_NOT_SIGNED = "body_not_signed", 401, "the body is not the one the signature covers"
    # -- who may ask ----------------------------------------------------------------------------------------
    NOT_OPERATOR = "not_operator", 403, "the endpoint is for operator keys"
    UNKNOWN_NODE = "unknown_node", 403, "the key is not registered (a new database?): register again"
    BANNED = "banned", 403, "the pool banned this key: its work is no longer accepted"
    BAD_CHALLENGE = "bad_challenge", 401, "unknown, expired or already used registration challenge: ask a new one"
    BAD_PUBLIC_KEY = "bad_public_key", 422, "not a hex Ed25519 public key"
    RATE_LIMITED = "rate_limited", 429, "too many requests: wait for the Retry-After header's seconds"
    # -- the request itself ---------------------------------------------------------------------------------
    INVALID_PAYLOAD = "invalid_payload", 422, "the body does not fit the endpoint's schema (the reason says where)"
    INVALID_REQUEST = "invalid_request", 422, "a path or query parameter is out of bounds"
    MALFORMED_CONTENT_LENGTH = "malformed_content_length", 400, "the Content-Length header is not a number"
    BODY_TOO_LARGE = "body_too_large", 413, "the body is over the endpoint's size limit"
    MALFORMED_IDEMPOTENCY_KEY = "malformed_idempotency_key", 422, "the Idempotency-Key header is malformed"
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused", 422, "the Idempotency-Key was used for another request"
    REPLAYED = "replayed", 409, "the signature's nonce was used before: sign each try afresh"
    NOT_FOUND = "not_found", 404, "no such endpoint"
    METHOD_NOT_ALLOWED = "method_not_allowed", 405, "the endpoint does not take this method"
    # -- leases and submissions -----------------------------------------------------------------------------
    PROMPTS_IN_FLIGHT = "prompts_in_flight", 429, "the identity holds as many prompts as it may: submit first"
    LEASES_IN_FLIGHT = "leases_in_flight", 429, "the node holds as many open leases as it may: submit first"
    DUPLICATE_PROMPT = "duplicate_prompt", 422, "one prompt appears twice in a submission"
    BAD_GROUP_SIGNATURE = "bad_group_signature", 422, "a group's node signature does not verify: sign each group"
    UNKNOWN_LEASE = "unknown_lease", 404, "no such lease (or an earlier try of this submission settled it)"
    LEASE_OF_ANOTHER_NODE = "lease_of_another_node", 403, "the lease was issued to another node"
    LEASE_EXPIRED = "lease_expired", 410, "the lease expired before the submission came"
    STALE_SUBMISSION = "stale_submission", 409, "generated with a policy version too old to train on"
    # -- operators: verifier, trainer -----------------------------------------------------------------------
    INVALID_VERDICT = "invalid_verdict", 422, "a verdict's rewards do not fit its group"
    INVALID_METRICS = "invalid_metrics", 422, "a trainer metrics report is malformed"
    CURSOR_AHEAD = "cursor_ahead", 409, "a feed cursor beyond the last position handed out"
    NOT_SHA256 = "not_sha256", 400, "a shard address that is not a sha256"
    SHARD_NOT_SIGNED = "shard_not_signed", 422, "the signature is for another shard"
    NO_SUCH_SHARD = "no_such_shard", 404, "the coordinator does not hold this shard"
    NO_SUCH_MANIFEST = "no_such_manifest", 404, "the coordinator has no manifest of this version"
    INVALID_MANIFEST = "invalid_manifest", 422, "the manifest does not hold together"
    WRONG_RUN = "wrong_run", 409, "the manifest is for another run"
    SHARD_MISSING = "shard_missing", 409, "the manifest names a shard not uploaded, or of another size"
    VERSION_NOT_NEWER = "version_not_newer", 409, "the version published is not newer than the current one"
    # -- the coordinator's own trouble: wait and retry ------------------------------------------------------
    UNAVAILABLE = "unavailable", 503, "the coordinator or its database is overloaded or restarting: retry later"
    DISK_FULL = "disk_full", 507, "the coordinator's disk is full: nothing was stored; retry later"
    INTERNAL_ERROR = "internal_error", 500, "a bug in the coordinator (logged there)"

    @classmethod
    def parse(cls, value: object) -> RefusalCode | None:
        """The code `value` names, or None (a body without one: an older coordinator, a proxy's own answer)."""
        try:
            return cls(value)
        except ValueError:
            return None


class ErrorBody(BaseModel):
    """Every error answer of the coordinator: the reason, in words a node operator can act on, and its code, which
    is what programs act on."""

    detail: str = Field(description="Why, for people; its words may change.")
    code: RefusalCode = Field(description="Why, for programs: the contract (protocol.refusals.RefusalCode).")


def error_body(code: RefusalCode, reason: str) -> bytes:
    """The JSON bytes of the error answer for `code` with `reason`."""
    return ErrorBody(detail=reason, code=code).model_dump_json().encode()
