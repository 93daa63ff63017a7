"""What an operator sees at a glance (GET /v1/overview, the dashboard): group outcomes and why groups were
rejected, node states, how far each checkpoint has spread among live nodes, and the ledger's totals.

Every list is bounded, so the answer stays small however large the pool."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MAX_REASONS = 20
MAX_SPREAD_VERSIONS = 32


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReasonCount(_Strict):
    reason: str = Field(description="A rejection reason with its numbers replaced by '#' (one line per kind).")
    groups: int
    example: str = Field(description="One reason of this kind, as the verifier wrote it.")


class VersionSpread(_Strict):
    version: int = Field(description="A policy version nodes hold (-1: none yet).")
    nodes: int = Field(description="Live, unbanned nodes holding it as their newest.")


class Overview(_Strict):
    now: float = Field(description="The coordinator's clock, unix seconds (node liveness is judged against it).")
    current_version: int
    groups: dict[str, int] = Field(description="Groups by outcome: pending, held, accepted, rejected.")
    reasons: list[ReasonCount] = Field(max_length=MAX_REASONS, description="Rejection reasons, most frequent first.")
    nodes: dict[str, int] = Field(description="Nodes by state: live, gone (not heard from for gone_after_s), banned.")
    gone_after_s: float
    spread: list[VersionSpread] = Field(max_length=MAX_SPREAD_VERSIONS,
                                        description="Live, unbanned nodes per held version, newest version first.")
    ledger_groups: int = Field(description="Accepted groups in the ledger (every node, every version).")
    ledger_tokens: int
    receipts: int = Field(description="Receipts signed so far.")
