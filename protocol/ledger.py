"""The contribution ledger as the coordinator serves it (GET /v1/ledger): for every node and policy version, the
groups the verifier accepted and their completion tokens, paginated by a cursor.

The ledger is the operator's book; a node's signed receipts (`protocol.receipts`) are its own, and add up to the
same groups and tokens for that node.
"""

from __future__ import annotations

from pydantic import Field

from swarmrl.protocol.strict import Strict

MAX_LEDGER_PAGE = 1000


class LedgerEntry(Strict):
    """Accepted work of one node at one policy version."""

    node_id: str
    name: str = Field(description="The node's self-chosen name (untrusted text).")
    policy_version: int
    groups: int = Field(description="Groups accepted.")
    tokens: int = Field(description="Completion tokens of those groups.")
    last_accepted_at: float = Field(description="When the last of them was accepted (coordinator clock).")
    cursor: int = Field(description="This entry's position in the ledger (pass it as `after` for the next page).")


class NodeContribution(Strict):
    """Accepted work of one node over every policy version."""

    node_id: str
    name: str = Field(description="The node's self-chosen name (untrusted text).")
    groups: int = Field(description="Groups accepted.")
    tokens: int = Field(description="Completion tokens of those groups.")
    versions: int = Field(description="Policy versions it contributed to.")
    last_accepted_at: float = Field(description="When its last group was accepted (coordinator clock).")


class Contributors(Strict):
    """The largest contributors (GET /v1/ledger/nodes), most tokens first: one row per node."""

    nodes: list[NodeContribution] = Field(max_length=MAX_LEDGER_PAGE)


class LedgerPage(Strict):
    entries: list[LedgerEntry] = Field(max_length=MAX_LEDGER_PAGE)
    next_after: int | None = Field(description="`after` for the next page; None when this page is the last.")
