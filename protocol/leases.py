"""Leases, signed by the coordinator: what a node acts on, and what the verifier judges its groups against.

One signature (`signing.sign`, kind `KIND_GRANT`, the pool's name) covers a lease's terms (id, node, policy
version, expiry, sampling) and the sha256 of each prompt (`prompt_digest`: id, text, seeds):

    body = canonical_json({"lease_id", "node_id", "policy_version", "expires_at", "sampling", "prompts": [digest...]})

So a node refuses a lease that was rewritten on the way (a prompt, max_tokens, the temperature, a seed: nothing
it would be judged on can be changed without the coordinator's key), and any one prompt can be shown to a verifier
with the lease's signature and the other prompts' digests (`LeaseExcerpt`), without the whole lease.
"""

from __future__ import annotations

from pydantic import Field

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.protocol.run import SamplingSpec
from swarmrl.protocol.signing import Signature, SignatureError, canonical_json, sha256_hex, sign, verify_signed
from swarmrl.protocol.strict import Strict

KIND_GRANT = "lease.grant"
"""The kind of the coordinator's signature over a lease (the request for one is `messages.KIND_LEASE`)."""
MAX_PROMPTS_PER_LEASE = 256


class LeasedPrompt(Strict):
    prompt_id: str = Field(max_length=64)
    text: str
    seeds: list[int] = Field(description="One sampling seed per rollout, chosen by the coordinator.")


def prompt_digest(p: LeasedPrompt) -> str:
    return sha256_hex(canonical_json(p.model_dump(mode="json")))


def _terms(lease_id: str, node_id: str, policy_version: int, expires_at: float, sampling: SamplingSpec,
           digests: list[str]) -> bytes:
    return canonical_json({"lease_id": lease_id, "node_id": node_id, "policy_version": policy_version,
                           "expires_at": expires_at, "sampling": sampling.model_dump(mode="json"), "prompts": digests})


class Lease(Strict):
    """Prompts leased to one node, with the seeds and sampling it must use, signed by the coordinator."""

    lease_id: str = Field(max_length=64)
    node_id: str = Field(max_length=40, description="The node the lease was issued to.")
    policy_version: int = Field(description="Coordinator's current version when the lease was issued.")
    expires_at: float
    sampling: SamplingSpec
    prompts: list[LeasedPrompt] = Field(max_length=MAX_PROMPTS_PER_LEASE)
    signature: Signature = Field(description="The coordinator's signature of the lease's terms (module docstring).")

    @classmethod
    def issue(cls, coordinator: Identity, pool: str, *, lease_id: str, node_id: str, policy_version: int,
              expires_at: float, sampling: SamplingSpec, prompts: list[LeasedPrompt]) -> Lease:
        """A lease signed by `coordinator` for `pool`."""
        return cls.issue_with_digests(coordinator, pool, lease_id=lease_id, node_id=node_id,
                                      policy_version=policy_version, expires_at=expires_at, sampling=sampling,
                                      prompts=prompts)[0]

    @classmethod
    def issue_with_digests(cls, coordinator: Identity, pool: str, *, lease_id: str, node_id: str,
                           policy_version: int, expires_at: float, sampling: SamplingSpec,
                           prompts: list[LeasedPrompt]) -> tuple[Lease, list[str]]:
        """`issue`, and the prompts' digests it signed (`digests()`, without computing them again)."""
        digests = [prompt_digest(p) for p in prompts]
        body = _terms(lease_id, node_id, policy_version, expires_at, sampling, digests)
        lease = cls(lease_id=lease_id, node_id=node_id, policy_version=policy_version, expires_at=expires_at,
                    sampling=sampling, prompts=prompts, signature=sign(coordinator, KIND_GRANT, pool, body))
        return lease, digests

    def digests(self) -> list[str]:
        return [prompt_digest(p) for p in self.prompts]

    def verify(self, coordinator_key: str, pool: str) -> None:
        """SignatureError unless every term and prompt of this lease is as `coordinator_key` signed it for `pool`."""
        body = _terms(self.lease_id, self.node_id, self.policy_version, self.expires_at, self.sampling, self.digests())
        verify_signed(self.signature, body, kind=KIND_GRANT, pool=pool, key=coordinator_key, max_skew_s=None)

    def excerpt(self, prompt_id: str) -> LeaseExcerpt:
        """The one prompt `prompt_id`, provable with this lease's signature."""
        index = next(i for i, p in enumerate(self.prompts) if p.prompt_id == prompt_id)
        return LeaseExcerpt(lease_id=self.lease_id, node_id=self.node_id, policy_version=self.policy_version,
                            expires_at=self.expires_at, sampling=self.sampling, prompt=self.prompts[index],
                            index=index, digests=self.digests(), signature=self.signature)


class LeaseExcerpt(Strict):
    """One prompt of a signed lease, with what checking the lease's signature needs: its terms and the digests of
    all its prompts (this one's at `index`). The verifier judges a group against this, never against anything the
    coordinator did not sign for the node."""

    lease_id: str = Field(max_length=64)
    node_id: str = Field(max_length=40)
    policy_version: int
    expires_at: float
    sampling: SamplingSpec
    prompt: LeasedPrompt
    index: int = Field(ge=0, lt=MAX_PROMPTS_PER_LEASE)
    digests: list[str] = Field(min_length=1, max_length=MAX_PROMPTS_PER_LEASE)
    signature: Signature

    def verify(self, coordinator_key: str, pool: str) -> None:
        """SignatureError unless this prompt belongs to a lease `coordinator_key` signed for `pool`."""
        if self.index >= len(self.digests) or self.digests[self.index] != prompt_digest(self.prompt):
            raise SignatureError(RefusalCode.BAD_SIGNATURE, "the prompt is not the one the lease's signature covers")
        body = _terms(self.lease_id, self.node_id, self.policy_version, self.expires_at, self.sampling, self.digests)
        verify_signed(self.signature, body, kind=KIND_GRANT, pool=pool, key=coordinator_key, max_skew_s=None)


def lease_problem(excerpt: LeaseExcerpt, node_id: str, prompt_id: str, coordinator_key: str, pool: str) -> str | None:
    """Why a group of `node_id` for `prompt_id` cannot be judged against `excerpt`, or None when it can."""
    try:
        excerpt.verify(coordinator_key, pool)
    except SignatureError as e:
        return f"the lease does not verify: {e.reason}"
    if excerpt.node_id != node_id:
        return "the lease was issued to another node"
    if excerpt.prompt.prompt_id != prompt_id:
        return "the group is for another prompt than the lease excerpt"
    return None
