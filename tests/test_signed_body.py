"""Signed request bodies are verified as sent: the signature covers the sha256 of the body's bytes, whatever JSON
the sender wrote, so a receiver checks the header, then the digest of the raw bytes, and parses them once, never
encoding a payload again. A body that differs in any byte, a header moved to another kind, pool or body, or a
malformed header is refused."""

from __future__ import annotations

import json

import pytest

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import SignatureError, canonical_json, parse_header, pool_id, sign, verify_signed

PAYLOAD = {"lease_id": "L1", "policy_version": 3, "logprobs": [-1.25, -3.4e-06, -0.0], "name": "n\u00e9ud \u2603",
           "nested": {"z": [1, 2, {"b": True, "a": None}], "a": 2**62}}
POOL = pool_id("run", "ab" * 32)


def _open(header: str, body: bytes, kind: str = "submit", pool: str = POOL) -> dict:
    """What a receiver does: the header, then the body as sent, then one parse."""
    verify_signed(parse_header(header), body, kind=kind, pool=pool)
    return json.loads(body)


def test_bodies_of_any_encoding_open_to_what_was_sent() -> None:
    me = Identity.generate()
    for body in (canonical_json(PAYLOAD), json.dumps(PAYLOAD, indent=2).encode(), json.dumps(PAYLOAD).encode()):
        header = sign(me, "submit", POOL, body).header()
        assert _open(header, body) == PAYLOAD
        assert parse_header(header).signer_id == me.node_id


@pytest.mark.parametrize("edit", [
    lambda b: b.replace(b'"policy_version":3', b'"policy_version":4'),          # the payload changed
    lambda b: b.replace(b'"lease_id":"L1"', b'"lease_id":"L1","extra":1'),     # a field added
    lambda b: b.replace(b"-1.25", b"-1.250"),                                   # the same value in other bytes
    lambda b: b + b" ",                                                          # one byte more
])
def test_a_body_that_is_not_the_one_signed_is_refused(edit) -> None:
    me = Identity.generate()
    body = canonical_json(PAYLOAD)
    header = sign(me, "submit", POOL, body).header()
    with pytest.raises(SignatureError, match="not the one signed"):
        _open(header, edit(body))


def test_a_header_moved_to_another_kind_pool_or_signer_is_refused() -> None:
    me, other = Identity.generate(), Identity.generate()
    body = canonical_json(PAYLOAD)
    header = sign(me, "submit", POOL, body).header()
    with pytest.raises(SignatureError, match="expected a 'lease' message"):
        _open(header, body, kind="lease")
    with pytest.raises(SignatureError, match="another pool"):
        _open(header, body, pool=pool_id("run", "cd" * 32))
    theirs = json.loads(sign(other, "submit", POOL, canonical_json({**PAYLOAD, "lease_id": "L2"})).header())
    spliced = json.dumps({**theirs, "key": me.public_key_hex, "body": json.loads(header)["body"]})
    with pytest.raises(SignatureError, match="bad signature"):  # my key and body digest, their signature
        _open(spliced, body)


def test_malformed_headers_are_refused_as_malformed() -> None:
    me = Identity.generate()
    body = canonical_json(PAYLOAD)
    header = sign(me, "submit", POOL, body).header()
    good = json.loads(header)
    for bad in (header[:-1], json.dumps({**good, "nonce": "x" + good["nonce"][1:]}), '{"kind": "submit"}', "[]",
                json.dumps({**good, "extra": 1}), json.dumps({**good, "ts": 2.0**64}), "x" * 5000):
        with pytest.raises(SignatureError, match="malformed"):
            parse_header(bad)
    with pytest.raises(SignatureError, match="missing"):
        parse_header(None)
