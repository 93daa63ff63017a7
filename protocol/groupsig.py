"""A node's own signature of each group it submits (`RolloutGroup.node_signature`).

The coordinator signs what it hands its verifiers and its trainer (`protocol.signing.verify_answer`), but a
coordinator whose store or process was tampered with signs a forgery as readily as the truth: it could hand the
verifier a group the node never sent, and have an honest node banned. So each group carries its node's signature,
and the verifier and the trainer check it themselves, against the node's public key: a group that does not verify
is not the node's doing, and is refused without a ban.

What is signed, with the one signing function (`protocol.signing.sign`, kind `KIND_GROUP`, for the pool), is
`group_body`: the canonical JSON of the group as it travels (its own `node_signature` left out, and every field at its
default: a field added to the protocol with a default leaves older signers' groups verifying), its lease id, the policy
version of its submission and the node id; each list of numbers in it (token ids, logprobs) is written as the sha256 of
its values packed as little-endian 64-bit integers or doubles. It is signed once for good (ts 0, a nonce derived from
the body), so only the Ed25519 signature travels: whoever checks it rebuilds the rest of the header from what it knows.
Floats survive the trip (JSON numbers read back as the same doubles); a non-finite one, which travels as null, is
signed as every receiver reads it.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

from pydantic import ValidationError

from swarmrl.protocol import PROTOCOL_VERSION
from swarmrl.protocol.identity import Identity, node_id_from_public_key
from swarmrl.protocol.messages import RolloutGroup
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.protocol.signing import Signature, SignatureError, canonical_json, sha256_hex, sign, verify

KIND_GROUP = "group"
_UNSIGNED = {"node_signature"}


def group_body(group: RolloutGroup, *, lease_id: str, policy_version: int, node_id: str) -> bytes:
    """The bytes a node signs for `group` of its submission under lease `lease_id` at `policy_version`: the same
    for the group as sent and as any receiver parses it (canonical JSON; the group's signature left out)."""
    facts = {"lease_id": lease_id, "policy_version": policy_version, "node_id": node_id}
    try:
        return canonical_json({"group": _packed(group.model_dump(exclude=_UNSIGNED, exclude_defaults=True)), **facts})
    except ValueError:  # a non-finite number, which the group's JSON carries as null: sign the group receivers read
        wire = group.model_dump_json()
        try:
            read = RolloutGroup.model_validate_json(wire)
        except ValidationError:  # a null where a number must be: receivers refuse the request whole
            return canonical_json({"group": wire, **facts})
        return canonical_json({"group": _packed(read.model_dump(exclude=_UNSIGNED, exclude_defaults=True)), **facts})


def _packed(value: Any) -> Any:
    """`value` (a model's dump) with each list of numbers (token ids, logprobs) replaced by the sha256 of their
    little-endian 64-bit values: bit for bit what was sent, and several times cheaper than writing each number."""
    if isinstance(value, dict):
        return {k: _packed(v) for k, v in value.items()}
    if isinstance(value, list):
        if value and not isinstance(value[0], (dict, list, str)):
            packed = _numbers(value)
            if packed is not None:
                return packed
        return [_packed(v) for v in value]
    return value


def sign_group(identity: Identity, group: RolloutGroup, *, lease_id: str, policy_version: int,
               pool: str) -> RolloutGroup:
    """`group` with `identity`'s signature of it (`node_signature`) for a submission under `lease_id` at
    `policy_version` in `pool`; signing the same group again gives the same signature."""
    body = group_body(group, lease_id=lease_id, policy_version=policy_version, node_id=identity.node_id)
    sig = sign(identity, KIND_GROUP, pool, body, ts=0.0, nonce=sha256_hex(body)[:32])
    return group.model_copy(update={"node_signature": sig.sig})


def verify_group(group: RolloutGroup, *, node_key: str, node_id: str, lease_id: str, policy_version: int,
                 pool: str) -> None:
    """SignatureError unless `group` carries the signature of `node_key` (whose id is `node_id`) for a submission
    under `lease_id` at `policy_version` in `pool`, over exactly this content."""
    if group.node_signature is None:
        raise SignatureError(RefusalCode.UNSIGNED, "the group carries no node signature")
    try:
        owner = node_id_from_public_key(node_key)
    except ValueError:
        raise SignatureError(RefusalCode.WRONG_KEY, "the node's public key is not an Ed25519 key") from None
    if owner != node_id:
        raise SignatureError(RefusalCode.WRONG_KEY, f"the public key given is not node {node_id[:16]}'s")
    body = group_body(group, lease_id=lease_id, policy_version=policy_version, node_id=node_id)
    digest = sha256_hex(body)
    try:
        sig = Signature(v=PROTOCOL_VERSION, kind=KIND_GROUP, pool=pool, key=node_key.lower(), nonce=digest[:32],
                        ts=0.0, body=digest, sig=group.node_signature)
    except ValidationError:
        raise SignatureError(RefusalCode.MALFORMED_SIGNATURE, "the group's node signature is malformed") from None
    verify(sig, kind=KIND_GROUP, pool=pool, key=node_key, max_skew_s=None)


def _numbers(values: list[Any]) -> dict[str, str] | None:
    """{"q": digest} for 64-bit integers, {"d": digest} for doubles, None for anything else (an integer beyond 64
    bits, which receivers refuse, is written out)."""
    for code in "qd":  # integers first: "q" refuses floats, where "d" would take integers
        try:
            packed = array(code, values)
        except TypeError:
            continue
        except OverflowError:
            return None
        if sys.byteorder == "big":
            packed.byteswap()
        return {code: sha256_hex(packed.tobytes())}
    return None
