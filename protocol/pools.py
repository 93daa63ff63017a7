"""Public compute pools: the signed record a coordinator announces, and the one rule that says why a record is
refused.

A coordinator announces its pool in the DHT as a `SignedPoolRecord`: a `PoolRecord` (what a volunteer needs to
decide and to join: name, model, task, coordinator URLs and key, the pool's current state) signed with the
coordinator's Ed25519 key over its canonical JSON with a domain prefix, the way `SignedManifest` is. Whoever
reads the DHT trusts nothing but that signature and `pool_record_problem`:

- bad signature: the record was not signed by the key it names (a forgery, or a tampered copy);
- mismatched: the record is stored under another key's slot than its own (`subkey`), or a DHT entry lives longer
  than the record says it may (`dht_expiration`: an old copy given a new life to shadow the newest);
- expired, or issued in the future beyond the allowed clock skew;
- pinned: a node that joined pool NAME once remembers its key, and a record of that name under another key is
  refused (someone else claims the name, or the operator changed keys: the node says which, loudly);
- replayed: a record whose sequence number is older than one already seen for its key (or the same sequence
  number with other contents), e.g. an old copy stored again to shadow the newest one.

This module is the contract only: no DHT, no files. `swarmrl.pools` stores and reads the records in a hivemind
DHT and keeps the pins and the sequence numbers seen.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from swarmrl.protocol.identity import Identity, verify_signature
from swarmrl.protocol.pydantic_errors import describe_validation_error
from swarmrl.protocol.signing import DEFAULT_CLOCK_SKEW_S, canonical_json

POOL_DOMAIN = b"swarmrl-pool\n"
POOL_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,47}$"
MAX_POOL_TTL_S = 3600.0
"""A record is valid for at most an hour after it was issued, which bounds how long a captured copy is useful."""
MAX_POOL_URLS = 4
MAX_RECORD_BYTES = 8192
"""Largest serialized signed record a reader parses (the fields' bounds keep an honest one far below)."""

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class PoolRecord(BaseModel):
    """What a coordinator says about its pool. Every field is bounded; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=POOL_NAME_PATTERN, description="Short name nodes join by (`swarmrl node --pool NAME`).")
    description: str = Field("", max_length=500, description="What the pool is for, in a sentence or two.")
    model: str = Field("", max_length=256, description="What is being trained (RunSpec.model).")
    task: str = Field("", max_length=64, description="The task's name (RunSpec.task.name).")
    coordinator_urls: list[str] = Field(min_length=1, max_length=MAX_POOL_URLS,
                                        description="Base URLs of the coordinator's HTTP API, preferred first.")
    coordinator_key: str = Field(description="The coordinator's Ed25519 public key, hex: it signs this record, "
                                 "every manifest and every receipt.")
    current_version: int = Field(-1, ge=-1, description="Newest published policy version; -1 before the first.")
    nodes: int = Field(0, ge=0, description="Nodes seen recently (not banned).")
    accepted_tokens: int = Field(0, ge=0, description="Completion tokens of every group the pool has accepted.")
    status: Literal["open", "paused", "closing"] = Field(
        "open", description="open: takes new nodes; paused: running, not taking new nodes; closing: winding down.")
    issued_at: float = Field(description="Unix seconds when the coordinator signed the record.")
    expires_at: float = Field(description="Unix seconds after which the record is void.")
    seq: int = Field(ge=0, description="Sequence number, strictly increasing per coordinator key (milliseconds "
                     "since the epoch at issue time, bumped when that would not increase).")

    @field_validator("coordinator_urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for u in urls:
            if len(u) > 256 or not re.match(r"^https?://[^\s/]+(/\S*)?$", u):
                raise ValueError(f"not an http(s) URL: {u[:80]!r}")
        return urls

    @field_validator("coordinator_key")
    @classmethod
    def _hex_key(cls, key: str) -> str:
        if not _HEX64.match(key):
            raise ValueError("coordinator_key must be a 64-character lower-case hex Ed25519 public key")
        return key

    @model_validator(mode="after")
    def _lifetime(self) -> PoolRecord:
        if not self.issued_at < self.expires_at <= self.issued_at + MAX_POOL_TTL_S:
            raise ValueError(f"expires_at must be after issued_at and at most {MAX_POOL_TTL_S:.0f} s later")
        return self

    def signed_bytes(self) -> bytes:
        return POOL_DOMAIN + canonical_json(self.model_dump(mode="json"))


class SignedPoolRecord(BaseModel):
    """A `PoolRecord` with the Ed25519 signature of its `coordinator_key`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    record: PoolRecord
    signature: str = Field(min_length=128, max_length=128)

    @classmethod
    def sign(cls, record: PoolRecord, identity: Identity) -> SignedPoolRecord:
        if record.coordinator_key != identity.public_key_hex:
            raise ValueError("a pool record is signed by the coordinator key it names")
        return cls(record=record, signature=identity.sign(record.signed_bytes()))

    def signature_ok(self) -> bool:
        return verify_signature(self.record.coordinator_key, self.record.signed_bytes(), self.signature)

    def digest(self) -> str:
        """sha256 of the signed bytes: two records with the same sequence number must have the same digest."""
        return hashlib.sha256(self.record.signed_bytes()).hexdigest()


@dataclass(frozen=True)
class Seen:
    """The newest record seen so far for one coordinator key."""

    seq: int
    digest: str


def parse_signed_record(raw: object) -> SignedPoolRecord:
    """A SignedPoolRecord from its JSON text (as stored in the DHT); ValueError saying why it does not parse."""
    if not isinstance(raw, str | bytes):
        raise ValueError(f"malformed: a {type(raw).__name__}, not JSON text")
    if len(raw) > MAX_RECORD_BYTES:
        raise ValueError(f"malformed: {len(raw)} bytes, more than {MAX_RECORD_BYTES}")
    try:
        return SignedPoolRecord.model_validate_json(raw)
    except ValidationError as e:
        why = describe_validation_error(e, limit=3, root="record")
        raise ValueError(f"malformed: {why}") from None


class RecordProblem(StrEnum):
    """Why a pool record is refused, for programs (`pool_record_refusal` gives the words for people beside it)."""

    BAD_SIGNATURE = "bad_signature"
    MISMATCHED_SLOT = "mismatched_slot"
    FROM_THE_FUTURE = "from_the_future"
    EXPIRED = "expired"
    MISMATCHED_LIFETIME = "mismatched_lifetime"
    KEY_NOT_PINNED = "key_not_pinned"
    """Another key than the one the reader pinned for the pool's name: the pool's key changed, or a squatter."""
    REPLAYED = "replayed"


def pool_record_refusal(
    signed: SignedPoolRecord,
    *,
    now: float,
    max_skew_s: float = DEFAULT_CLOCK_SKEW_S,
    subkey: str | None = None,
    dht_expiration: float | None = None,
    pinned_key: str | None = None,
    seen: Seen | None = None,
) -> tuple[RecordProblem, str] | None:
    """Why `signed` is refused (its problem and the reason in words), or None when it is acceptable. Checks, in
    order: the signature; that it sits in its own key's slot (`subkey`); its lifetime against `now` (issued no later
    than `now + max_skew_s`, not expired), and that it lives no longer in the DHT than it says (`dht_expiration`);
    that its key is the one pinned for its name (`pinned_key`); that it is not older than the newest record already
    `seen` for its key."""
    rec = signed.record
    if not signed.signature_ok():
        return (RecordProblem.BAD_SIGNATURE,
                f"bad signature: not signed by the key it names ({rec.coordinator_key[:16]}…)")
    if subkey is not None and subkey != rec.coordinator_key:
        return (RecordProblem.MISMATCHED_SLOT,
                f"mismatched: stored under key {str(subkey)[:16]}… but names key {rec.coordinator_key[:16]}…")
    if rec.issued_at > now + max_skew_s:
        return (RecordProblem.FROM_THE_FUTURE, f"issued {rec.issued_at - now:.0f} s in the future (more than the "
                                               f"{max_skew_s:.0f} s clock skew allowed)")
    if rec.expires_at <= now:
        return RecordProblem.EXPIRED, f"expired {now - rec.expires_at:.0f} s ago"
    if dht_expiration is not None and dht_expiration > rec.expires_at:
        return (RecordProblem.MISMATCHED_LIFETIME,
                f"mismatched: stored to live {dht_expiration - rec.expires_at:.0f} s longer than it says it is valid")
    if pinned_key is not None and pinned_key != rec.coordinator_key:
        return (RecordProblem.KEY_NOT_PINNED, f"key {rec.coordinator_key[:16]}… does not match the key pinned for "
                                              f"pool {rec.name!r} ({pinned_key[:16]}…)")
    if seen is not None:
        if rec.seq < seen.seq:
            return (RecordProblem.REPLAYED,
                    f"replayed: sequence {rec.seq} is older than {seen.seq}, already seen for this key")
        if rec.seq == seen.seq and signed.digest() != seen.digest:
            return (RecordProblem.REPLAYED,
                    f"replayed: a different record with sequence {rec.seq}, already seen for this key")
    return None


def pool_record_problem(signed: SignedPoolRecord, **kw: Any) -> str | None:
    """Why `signed` is refused, in words (`pool_record_refusal`'s reason), or None when it is acceptable."""
    refusal = pool_record_refusal(signed, **kw)
    return None if refusal is None else refusal[1]
