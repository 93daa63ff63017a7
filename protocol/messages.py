"""Pydantic v2 schemas for every exchange between roles.

Bounds on every list, string and integer are part of the protocol: a message outside them is malformed and is
refused whole with a 422 before any of it is used. Every integer a receiver may store fits a signed 64-bit
database column (`Int64`, `Index64`, `VersionOrNone`), so an oversized number is a 422 with a reason, never a
database error. A signed request's body is one of these models as JSON; its `protocol.signing.Signature` (of
kind `KIND_*`) travels in the `protocol.signing.SIGNATURE_HEADER` HTTP header.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from swarmrl.protocol.episodes import MAX_TURNS
from swarmrl.protocol.leases import MAX_PROMPTS_PER_LEASE, Lease, LeasedPrompt, LeaseExcerpt
from swarmrl.protocol.manifest import CheckpointManifest, SignedManifest
from swarmrl.protocol.run import MAX_COMPLETION_TOKENS, MAX_GROUP_SIZE, RunInfo, SamplingSpec
from swarmrl.protocol.strict import Strict

# Message kinds: the receiver refuses a signature whose kind does not match the endpoint.
KIND_REGISTER = "register"
KIND_LEASE = "lease"
KIND_SUBMIT = "submit"
KIND_HEARTBEAT = "heartbeat"
KIND_VERIFIER_PENDING = "verifier.pending"
KIND_VERIFIER_VERDICTS = "verifier.verdicts"
KIND_TRAINER_BATCH = "trainer.batch"
KIND_TRAINER_SHARD = "trainer.shard"
KIND_TRAINER_PUBLISH = "trainer.publish"
KIND_TRAINER_METRICS = "trainer.metrics"
KIND_TRAINER_ACK = "trainer.ack"

MAX_PROMPT_TOKENS = 8192

INT64_END = 2**63
"""One past the largest integer a signed 64-bit database column holds."""
Int64 = Annotated[int, Field(ge=-INT64_END, lt=INT64_END)]
"""Any integer a signed 64-bit column holds (what it means, sign included, is checked elsewhere)."""
Index64 = Annotated[int, Field(ge=0, lt=INT64_END)]
"""A version, cursor, id, step or count: 0 <= x < 2**63."""
VersionOrNone = Annotated[int, Field(ge=-1, lt=INT64_END)]
"""A policy version, or -1 for none: -1 <= x < 2**63."""


class ChallengeRequest(Strict):
    public_key: str = Field(min_length=64, max_length=64)


class Challenge(Strict):
    challenge: str = Field(description="Random hex string the registrant must sign within `expires_at`.")
    expires_at: float


class RegisterRequest(Strict):
    """Signed with the key being registered: proves possession of the private key."""

    challenge: str = Field(max_length=128)
    name: str = Field("", max_length=64, description="Human-readable node name for dashboards.")
    engine: str = Field("", max_length=32, description="Inference engine the node runs (vllm, torch).")


class Registered(Strict):
    node_id: str
    run: RunInfo


class LeaseRequest(Strict):
    max_prompts: int = Field(8, ge=1, le=MAX_PROMPTS_PER_LEASE)
    held_version: VersionOrNone = Field(-1, description="Newest policy version the node holds (-1: none).")


class Rollout(Strict):
    seed: Int64 = Field(description="The leased seed this rollout was sampled with.")
    completion_ids: list[Int64] = Field(max_length=MAX_COMPLETION_TOKENS)
    logprobs: list[float] = Field(max_length=MAX_COMPLETION_TOKENS, description="Per completion token.")
    finish_reason: Literal["stop", "length"]
    claimed_reward: float | None = Field(None, description="Informational only: never used for training.")
    proof: str | None = Field(None, max_length=65536, description="Activation proof, base64 (optional); in a "
                              "multi-turn episode it covers the model's tokens only, in order.")
    turns: list[Int64] = Field(default_factory=list, max_length=2 * MAX_TURNS - 1, description="Multi-turn "
                               "episodes: the lengths of its turns in completion_ids, model and environment turns "
                               "alternating, model first and last (`protocol.episodes`); empty: one model turn.")


MAX_VERSION_SPANS = 64
"""Most version spans one group may record (in-flight updates, `RolloutGroup.version_spans`)."""
VersionSpan = tuple[Index64, Index64]
"""(index of the span's first completion token, the policy version that generated the span's tokens)."""


class RolloutGroup(Strict):
    prompt_id: str = Field(max_length=64)
    prompt_ids: list[Int64] = Field(max_length=MAX_PROMPT_TOKENS, description="Prompt as tokenized by the node.")
    rollouts: list[Rollout] = Field(min_length=1, max_length=MAX_GROUP_SIZE)
    node_signature: str | None = Field(None, pattern=r"^[0-9a-f]{128}$", description="The submitting node's "
                                       "Ed25519 signature of this group, its lease, policy version and node id "
                                       "(`protocol.groupsig`): the verifier and the trainer check it themselves and "
                                       "refuse the group without it. Clients sign every group they submit.")
    version_spans: list[VersionSpan] = Field(
        default_factory=list, max_length=MAX_VERSION_SPANS, description="In-flight updates "
        "(`SamplingSpec.in_flight_updates`): the version that generated each span of tokens, as (first token index, "
        "version) pairs: the first at token 0 with the submission's policy_version (the oldest), then indices and "
        "versions increasing; a span runs up to the next one's first token, in every rollout of the group. Empty: "
        "every token from the submission's policy_version.")

    @field_validator("version_spans")
    @classmethod
    def _spans_increase(cls, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        if spans and spans[0][0] != 0:
            raise ValueError(f"the first version span starts at token {spans[0][0]}, not 0")
        for (a, v), (b, w) in zip(spans, spans[1:], strict=False):
            if not (b > a and w > v):
                raise ValueError(f"version spans ({a}, {v}) then ({b}, {w}): token indices and versions must increase")
        return spans

    def span_versions(self, policy_version: int) -> list[tuple[int, int]]:
        """(first token index, version) of every span, for a group of a submission at `policy_version`."""
        return list(self.version_spans) or [(0, policy_version)]


class RolloutSubmission(Strict):
    lease_id: str = Field(max_length=64)
    policy_version: Index64 = Field(description="Version of the weights that generated every group here.")
    groups: list[RolloutGroup] = Field(min_length=1, max_length=MAX_PROMPTS_PER_LEASE)
    gen_seconds: float = Field(0.0, ge=0, description="Wall time the node spent generating (for metrics).")
    next_lease: LeaseRequest | None = Field(
        None, description="Ask for the next lease in the same request: the answer's `next_lease` holds it, granted "
        "once this submission has settled its lease, as POST /v1/lease would grant it. One round trip per lease "
        "instead of two.")

    @model_validator(mode="after")
    def _spans_start_at_the_version(self) -> RolloutSubmission:
        for g in self.groups:
            if g.version_spans and g.version_spans[0][1] != self.policy_version:
                raise ValueError(f"group {g.prompt_id[:64]!r}: its first version span is of version "
                                 f"{g.version_spans[0][1]}, the submission's policy_version is {self.policy_version}")
        return self


ALREADY_SUBMITTED = "already submitted"
"""A group's rejection in a `SubmitResult` when it was taken before (by an earlier try whose answer was lost): the
one rejection reason a node acts on (it counts the group as taken), so it is part of the contract."""


class SubmitResult(Strict):
    """Which groups were taken for verification. The receipts for those the verifier accepts come later, from
    GET /v1/receipts (`protocol.receipts`)."""

    accepted: list[str] = Field(description="Prompt ids taken for verification.")
    rejected: dict[str, str] = Field(description="Prompt id -> reason it was refused (`ALREADY_SUBMITTED` when an "
                                     "earlier try took it).")
    next_lease: Lease | None = Field(None, description="The lease the submission asked for (`next_lease`), signed "
                                     "like any other: the node checks it as it would an answer of POST /v1/lease.")
    next_lease_refused: str = Field("", max_length=1024, description="Why the next lease asked for was not granted "
                                    "(no work now, or the identity's allowance): ask POST /v1/lease later.")


MAX_NODE_SECONDS = 1e9
"""Bound on a node's self-reported time counters (about 31 years)."""


class Heartbeat(Strict):
    """A node's periodic sign of life, with its self-reported time counters.

    `idle_s` and `busy_s` are cumulative since the node process started (so they fall back towards 0 when
    it restarts). They are untrusted self-reports, used only for metrics (the swarm's idle share), never
    for any decision about the node or its groups.
    """

    held_version: VersionOrNone = Field(-1, description="Newest policy version the node holds (-1: none).")
    status: str = Field("", max_length=64)
    idle_s: float = Field(0.0, ge=0, le=MAX_NODE_SECONDS,
                          description="Untrusted self-report: seconds the node has waited for work or for recent "
                                      "enough weights since it started.")
    busy_s: float = Field(0.0, ge=0, le=MAX_NODE_SECONDS,
                          description="Untrusted self-report: seconds the node has spent generating and submitting "
                                      "since it started.")


MAX_WAIT_S = 10.0
"""Longest long poll an operator's request may ask for (it holds one of the coordinator's worker threads)."""


class PendingRequest(Strict):
    limit: int = Field(64, ge=1, le=1024)
    wait_s: float = Field(0.0, ge=0, le=MAX_WAIT_S, description="Long poll: when nothing is pending, wait up to "
                          "this long for a submission before answering (empty).")


class PendingGroup(Strict):
    """A submitted group awaiting verification, with the trusted facts the verifier needs: the answer, and the
    signed lease excerpt the group is judged against (its prompt, seeds, sampling and version are the lease's)."""

    group_id: int
    node_id: str
    node_key: str = Field(pattern=r"^[0-9a-f]{64}$", description="The node's public key: the verifier checks the "
                          "group's node signature (`protocol.groupsig`) against it before anything else.")
    answer: str = Field(description="Ground truth, known only to the coordinator side.")
    lease: LeaseExcerpt = Field(description="The prompt as leased, with the coordinator's signature of the lease.")
    policy_version: int
    group: RolloutGroup
    node_checks_passed: int = Field(0, description="Full checks the submitting node has passed so far (the "
                                                   "verifier's sampling policy checks every group until K).")
    node_held: int = Field(0, ge=0, description="Groups of the submitting node held (unchecked, unreleased) when "
                                                "this one was claimed: at `protocol.quarantine` max_held, its next "
                                                "group is fully checked.")
    node_source: str = Field("", max_length=256, description="The source (address) the node registered from, as the "
                             "coordinator saw it: the verifier charges a source's identities together.")
    draw: float = Field(ge=0, lt=1, description="The quarantine rule's random number for this group, drawn by the "
                        "coordinator at the group's first claim and kept by every re-claim, as are "
                        "node_checks_passed and node_held: a check that outlasts its claim is not drawn again.")

    @property
    def prompt_text(self) -> str:
        return self.lease.prompt.text

    @property
    def seeds(self) -> list[int]:
        return self.lease.prompt.seeds

    @property
    def sampling(self) -> SamplingSpec:
        return self.lease.sampling

    @property
    def lease_version(self) -> int:
        return self.lease.policy_version


class PendingGroups(Strict):
    """The groups a verifier's claim took (empty when there were none)."""

    groups: list[PendingGroup]


class Verdict(Strict):
    group_id: Index64
    accepted: bool
    reason: str = ""
    rewards: list[float] = Field(default_factory=list, description="Trusted rewards, one per rollout.")
    ban: bool = Field(False, description="The failure proves cheating: ban the node, drop its unreleased groups.")
    checked: bool = Field(True, description="Accepted after the full check. False: only the cheap checks ran; the "
                                            "coordinator holds the group until full checks of groups the same node "
                                            "submitted later have vouched for it (`protocol.quarantine.on_pass`; "
                                            "then it reaches the trainer), and drops it if the node is banned first.")
    vouches: bool = Field(True, description="For a checked acceptance: whether the check was drawn by the sampling "
                                            "rule (or the warm-up) and so vouches for the node's earlier held groups; "
                                            "False for a check forced by the held cap, which the node could foresee.")


class VerdictBatch(Strict):
    verdicts: list[Verdict] = Field(max_length=1024)


class BatchRequest(Strict):
    after_id: Index64 = Field(0, description="Return accepted groups with a larger id (the trainer's cursor).")
    limit: int = Field(64, ge=1, le=4096)
    wait_s: float = Field(0.0, ge=0, le=MAX_WAIT_S, description="Long poll: when no accepted group is after "
                          "after_id, wait up to this long for one before answering (empty).")


class FeedAck(Strict):
    """The trainer has durably saved the state that consumed every feed position up to `cursor`."""

    cursor: Index64 = Field(description="The largest TrainingGroup.group_id the saved trainer state has consumed.")


class FeedAcked(Strict):
    acked: int = Field(description="The acknowledged cursor now (never lower than before).")
    head: int = Field(description="The last feed position handed out so far.")


class TrainingGroup(Strict):
    """A verified group as the trainer takes it: the group as the node submitted it (its shape checked by
    `protocol.validation.group_problem` at submission), with the trusted rewards, one per rollout."""

    group_id: int = Field(description="The trainer feed's cursor value of this group.")
    policy_version: int
    group: RolloutGroup
    lease_id: str = Field(max_length=64, description="The lease the group was submitted under.")
    node_key: str = Field(pattern=r"^[0-9a-f]{64}$", description="The submitting node's public key: the trainer "
                          "refuses a group whose node signature (`protocol.groupsig`) does not verify against it.")
    rewards: list[float] = Field(description="Trusted rewards, one per rollout (in rollout order).")

    @model_validator(mode="after")
    def _one_reward_per_rollout(self) -> TrainingGroup:
        if len(self.rewards) != len(self.group.rollouts):
            raise ValueError(f"{len(self.rewards)} rewards for {len(self.group.rollouts)} rollouts")
        return self


class TrainingBatch(Strict):
    current_version: int
    groups: list[TrainingGroup]


class PublishRequest(Strict):
    manifest: CheckpointManifest

    @field_validator("manifest")
    @classmethod
    def _storable(cls, manifest: CheckpointManifest) -> CheckpointManifest:
        # The coordinator stores the version in a 64-bit column and the sizes in the manifest it signs.
        if manifest.version >= INT64_END:
            raise ValueError(f"version must be less than 2**63, got {manifest.version}")
        sizes = [manifest.shard_size] + [n for f in manifest.files for n in (f.size, *(s.size for s in f.shards))]
        if max(sizes) >= INT64_END:
            raise ValueError("file, shard and shard_size values must be less than 2**63")
        return manifest


class TrainerMetrics(Strict):
    """One trainer step's metrics. The coordinator adds, when it records them, the swarm's node idle time since
    the previous report: `node_idle_s` (summed over nodes) and `node_idle_frac` (idle / (idle + busy), left out
    when the nodes reported no time at all); both come from the nodes' untrusted heartbeat counters."""

    step: Index64
    version: Index64
    metrics: dict[str, float]


class NodeStatus(BaseModel):
    node_id: str
    name: str
    engine: str
    held_version: int
    groups_accepted: int
    groups_rejected: int
    banned: bool
    last_seen: float
    checks_passed: int = 0
    reputation: float = 0.5
    idle_s: float = Field(0.0, description="The node's last self-reported idle seconds since it started (untrusted).")
    busy_s: float = Field(0.0, description="The node's last self-reported busy seconds since it started (untrusted).")
    prompts_leased: int = Field(0, description="Prompts ever leased to the node.")
    prompts_abandoned: int = Field(0, description="Of those, how many it left unused (lease expired, left out of its "
                                                  "submission, or refused at submission): they were leased again.")
    lease_allowance: int = Field(0, description="Prompts the node may hold in flight now (earned by verified work, "
                                                "lowered by abandoned prompts).")
    gone_since: float | None = Field(None, description="When the coordinator marked the node gone for missing its "
                                                       "heartbeats (its leases were freed); None while it is live.")


MAX_PAGE = 1000
"""The most items one page of a list endpoint holds."""


class NodePage(BaseModel):
    """One page of the registered nodes, in node id order (GET /v1/nodes)."""

    nodes: list[NodeStatus]
    next_after: str | None = Field(None, description="Pass as `after` for the next page; None: this was the last.")


class MetricsReport(BaseModel):
    """A stored trainer metrics report with its position in the coordinator's list of reports."""

    id: int = Field(description="Position of the report (increasing); pages continue after it.")
    step: int
    version: int
    metrics: dict[str, float]
    ts: float = Field(description="When the coordinator recorded it (its clock, unix seconds).")


class MetricsPage(BaseModel):
    """One page of trainer metrics reports, oldest first (GET /v1/metrics/trainer)."""

    reports: list[MetricsReport]
    next_after: int | None = Field(None, description="Pass as `after` for the next page; None: this was the last.")


class RunStatus(BaseModel):
    """The run at a glance (GET /v1/status): counters of the whole run, the first page of nodes and the newest
    trainer reports. Every node and every report can be paged through with /v1/nodes and /v1/metrics/trainer."""

    run: RunInfo
    nodes: list[NodeStatus] = Field(description="The first page of nodes, in node id order (`nodes` query).")
    groups_pending: int
    groups_accepted: int
    groups_rejected: int
    metrics: list[TrainerMetrics] = Field(description="The newest trainer reports, oldest first (`metrics` query).")
    groups_held: int = Field(0, description="Accepted by cheap checks, waiting for a later full check of the node.")
    nodes_total: int = Field(0, description="Registered nodes, banned and gone ones included.")
    nodes_live: int = Field(0, description="Nodes neither banned nor gone.")
    nodes_gone: int = Field(0, description="Nodes marked gone for missing their heartbeats (not banned).")
    nodes_banned: int = 0
    nodes_next_after: str | None = Field(None, description="`after` for /v1/nodes to continue after `nodes`; None: "
                                                           "`nodes` holds every node.")


__all__ = [name for name in dir() if not name.startswith("_")] + [
    "CheckpointManifest", "SignedManifest", "RunInfo", "SamplingSpec", "Lease", "LeasedPrompt", "LeaseExcerpt",
    "MAX_PROMPTS_PER_LEASE"]
