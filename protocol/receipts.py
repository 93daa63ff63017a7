"""Receipts: the coordinator's signed word that it accepted one group of a node's work.

A receipt exists from the moment the verifier's verdict accepting the group is applied (or the group is released
from quarantine): the coordinator signs it then and keeps it in its receipt book. Nodes collect theirs later with
a signed `ReceiptsRequest` (GET /v1/receipts, the payload and its signature in the `x-swarmrl-payload` and
`x-swarmrl-signature` headers), page by page after the last `seq` they hold. The signature covers
`RECEIPT_DOMAIN` + the canonical JSON of every field but the signature, so anyone who knows the coordinator's
public key can check a receipt offline (`verify_receipt`), and a contribution can be proven without trusting the
operator's database.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from swarmrl.protocol.identity import Identity, verify_signature
from swarmrl.protocol.run import MAX_COMPLETION_TOKENS, MAX_GROUP_SIZE
from swarmrl.protocol.signing import canonical_json
from swarmrl.protocol.strict import Strict

RECEIPT_DOMAIN = b"swarmrl-receipt\n"
"""Prefixed to every receipt's signed bytes, so that no other signed message of the coordinator's can pass as one."""
KIND_RECEIPTS = "receipts"
"""Envelope kind of a node's request for its receipts."""
MAX_RECEIPTS_PER_PAGE = 1000

_INT64_END = 2**63
_Index64 = Annotated[int, Field(ge=0, lt=_INT64_END)]


class Receipt(Strict):
    """One accepted group of one node, signed by the coordinator (see the module docstring)."""

    run_id: str = Field(min_length=1, max_length=128, description="The run (pool) the work was done for.")
    seq: _Index64 = Field(description="The receipt's position in the coordinator's receipt book (1, 2, ...): the "
                                      "cursor a node collects its receipts after.")
    node_id: str = Field(min_length=40, max_length=40, description="The node the work is credited to.")
    lease_id: str = Field(max_length=64)
    prompt_id: str = Field(max_length=64, description="The group's prompt id within its lease.")
    policy_version: _Index64 = Field(description="The policy version the group was generated with.")
    tokens: int = Field(ge=0, le=MAX_GROUP_SIZE * MAX_COMPLETION_TOKENS, description="Completion tokens credited.")
    accepted_at: float = Field(description="Coordinator's clock when the group was accepted, unix seconds.")
    signature: str = Field(min_length=128, max_length=128, description="Coordinator's Ed25519 signature, hex.")

    def signed_bytes(self) -> bytes:
        return RECEIPT_DOMAIN + canonical_json(self.model_dump(mode="json", exclude={"signature"}))

    @classmethod
    def sign(cls, identity: Identity, **fields: object) -> Receipt:
        """A receipt for `fields` (every field but the signature) signed by `identity` (the coordinator)."""
        unsigned = cls.model_validate({**fields, "signature": "0" * 128})
        return unsigned.model_copy(update={"signature": identity.sign(unsigned.signed_bytes())})


def verify_receipt(receipt: Receipt, coordinator_key: str, node_id: str | None = None,
                   run_id: str | None = None) -> str | None:
    """Why `receipt` is not a valid receipt of `coordinator_key` (for `node_id` and for run `run_id`, when given),
    or None. One coordinator key may serve several runs: a receipt of another run is work for that run."""
    if run_id is not None and receipt.run_id != run_id:
        return f"for run {receipt.run_id!r}, not {run_id!r}"
    if node_id is not None and receipt.node_id != node_id:
        return f"issued to node {receipt.node_id[:12]}…, not to this node"
    try:
        message = receipt.signed_bytes()
    except ValueError as e:
        return f"cannot be encoded canonically: {e}"
    if not verify_signature(coordinator_key, message, receipt.signature):
        return "bad signature: not signed by the coordinator's key"
    return None


class ReceiptsRequest(Strict):
    """A node asks for its own receipts (the signer's), oldest first."""

    after: _Index64 = Field(0, description="Only receipts with a larger seq (the last seq the node holds).")
    limit: int = Field(200, ge=1, le=MAX_RECEIPTS_PER_PAGE)


class ReceiptPage(Strict):
    receipts: list[Receipt] = Field(max_length=MAX_RECEIPTS_PER_PAGE)
    next_after: int = Field(description="The cursor for the next page: the last seq here, or `after` when empty.")
    head: int = Field(description="The largest seq issued to this node so far (0: none). A node holding a larger "
                                  "seq talks to a coordinator that lost its receipt book: it starts again from 0.")
