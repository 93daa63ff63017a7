"""Signed request bodies as the client sends them (`signed_body`: the payload's canonical bytes are signed and
sent as they are) open through the fast path of `open_signed`, which verifies the bytes as sent; anything else
(another encoding, a tampered or forged body) goes the general way and is refused exactly as before."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import SignatureError, canonical_json, open_signed, sign, signed_body

PAYLOAD = {"lease_id": "L1", "policy_version": 3, "logprobs": [-1.25, -3.4e-06, -0.0], "name": "n\u00e9ud \u2603",
           "nested": {"z": [1, 2, {"b": True, "a": None}], "a": 2**62}}


def test_bodies_of_both_encodings_open_to_the_same_envelope() -> None:
    me = Identity.generate()
    fast = open_signed(signed_body(me, "submit", PAYLOAD), kind="submit")
    general = open_signed(sign(me, "submit", PAYLOAD).model_dump_json().encode(), kind="submit")
    for env, payload_json in (fast, general):
        assert env.payload == PAYLOAD and payload_json == canonical_json(PAYLOAD)
        assert env.signer_id == me.node_id


@pytest.mark.parametrize("edit", [
    lambda b: b.replace(b'"policy_version":3', b'"policy_version":4'),          # the payload changed
    lambda b: b.replace(b'"lease_id":"L1"', b'"lease_id":"L1","extra":1'),     # a field added
    lambda b: b.replace(b'"kind": "submit"', b'"kind": "lease"'),              # the kind changed
])
def test_a_tampered_body_is_refused(edit) -> None:
    me = Identity.generate()
    body = edit(signed_body(me, "submit", PAYLOAD))
    kind = "lease" if b'"kind": "lease"' in body else "submit"
    with pytest.raises(SignatureError):
        open_signed(body, kind=kind)


def test_the_same_payload_in_other_bytes_is_the_same_signed_message() -> None:
    me = Identity.generate()
    body = signed_body(me, "submit", PAYLOAD).replace(b"-1.25", b"-1.250")  # what was signed is the value
    env, payload_json = open_signed(body, kind="submit")
    assert env.payload == PAYLOAD and payload_json == canonical_json(PAYLOAD)


def test_another_signers_payload_cannot_be_spliced_in() -> None:
    me, other = Identity.generate(), Identity.generate()
    mine, theirs = signed_body(me, "submit", PAYLOAD), signed_body(other, "submit", {**PAYLOAD, "lease_id": "L2"})
    at_mine, at_theirs = mine.index(b', "payload": '), theirs.index(b', "payload": ')
    spliced = mine[:at_mine] + theirs[at_theirs:]  # my header, their payload and signature
    with pytest.raises(SignatureError):
        open_signed(spliced, kind="submit")


def test_malformed_bodies_are_refused_as_malformed() -> None:
    me = Identity.generate()
    body = signed_body(me, "submit", PAYLOAD)
    for bad in (body[:-1], body.replace(b'"nonce": "', b'"nonce": "x'), b'{"kind": "submit"}', b"[]",
                body.replace(b', "payload": {', b', "payload": [')):
        with pytest.raises((ValidationError, SignatureError)):
            open_signed(bad, kind="submit")
    not_json = body.replace(b"-1.25", b"NaN")
    with pytest.raises((ValidationError, SignatureError, ValueError)):
        open_signed(not_json, kind="submit")
    assert json.loads(body)["payload"] == PAYLOAD
