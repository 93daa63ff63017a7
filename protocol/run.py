"""The run description: the one source of every fact of a training run that the roles must agree on.

The operator writes it once, as the `[run]` table of the coordinator's config. The coordinator serves it in
`RunInfo` (GET /v1/info) with the facts that change while the run goes on (the current policy version, the DHT
bootstrap peers); every other role reads it from there instead of keeping its own copy:

- nodes: how to sample (`sampling`), how stale their weights may be (`max_staleness`), which proofs to attach;
- the verifier: the task whose reward it recomputes, the staleness bound, the proof parameters it requires;
- the trainer: the task it evaluates on, the staleness bound, the sampling temperature its loss must use, and the
  corrections of the gap between the nodes' and its own token probabilities (`corrections`).

A verifier or trainer whose own config names a `run` refuses to start when it differs (`RunSpec.mismatch`),
so a role configured for another run cannot quietly train or verify against the wrong facts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from swarmrl.protocol import proofs
from swarmrl.protocol.episodes import MAX_TURNS, EnvironmentSpec
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.signing import Signature, canonical_json, pool_id, sha256_hex, sign, verify_signed
from swarmrl.protocol.strict import Strict
from swarmrl.protocol.tasks import TaskSpec

MAX_COMPLETION_TOKENS = 4096
MAX_GROUP_SIZE = 64


class SamplingSpec(Strict):
    """How every rollout of a lease is sampled. Fixed by the run, never chosen by a node."""

    temperature: float = Field(1.0, gt=0, le=10, description="Softmax temperature.")
    max_tokens: int = Field(8, ge=1, le=MAX_COMPLETION_TOKENS, description="Completion length cap (of each model "
                            "turn, in a multi-turn episode).")
    group_size: int = Field(8, ge=2, le=MAX_GROUP_SIZE, description="Rollouts per prompt (the GRPO group).")
    max_turns: int = Field(1, ge=1, le=MAX_TURNS, description="Model turns an episode may have; above 1 the run's "
                           "`environment` answers each turn but the last (`protocol.episodes`).")
    max_episode_tokens: int | None = Field(
        None, ge=1, le=MAX_COMPLETION_TOKENS, description="Tokens of a whole episode, the environment's included: a "
        "reply that leaves no room for a model token ends the episode ('length'). None: max_tokens x max_turns.")
    in_flight_updates: bool = Field(
        False, description="Nodes may load a newer policy version between decode chunks of a lease, without "
        "draining: each group then records the version of every span of its tokens (`RolloutGroup.version_spans`), "
        "the verifier replays each span with its version, and staleness is judged by the oldest span. Needs "
        "max_staleness >= 1 and single-turn episodes.")
    update_chunk_tokens: int = Field(
        1, ge=1, le=MAX_COMPLETION_TOKENS, description="With in_flight_updates: decode steps between two looks for a "
        "newer version (a look costs a comparison; a span may start at any token).")

    @property
    def episode_tokens(self) -> int:
        """The whole completion's cap: `max_episode_tokens`, else max_tokens x max_turns (at most the protocol's)."""
        return self.max_episode_tokens or min(self.max_tokens * self.max_turns, MAX_COMPLETION_TOKENS)


class ProofSpec(Strict):
    """The activation proofs (`protocol.proofs`) every rollout carries."""

    required: bool = Field(True, description="Rollouts without a proof are refused (without a ban).")
    chunk_tokens: int = Field(proofs.CHUNK_TOKENS, ge=1, le=255, description="Tokens per proof chunk.")
    topk: int = Field(proofs.TOPK, ge=1, le=255, description="Hidden-state entries committed per token.")


class CorrectionSpec(Strict):
    """How the trainer corrects the gap between the probability a node's engine gave a token (the logprob the rollout
    carries) and the trainer's own: rho = pi_trainer / pi_engine per token (`trainer.grpo` says which trainer policy).
    Both corrections are off by default: on the fp32 CPU path the two agree to 1e-6 and there is nothing to correct."""

    tis_cap: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="Token-level truncated importance sampling: each token's "
        "policy-gradient term is weighted by min(rho, tis_cap) (2 is usual); None: off.")
    mask_band: tuple[float, float] | None = Field(
        None, description="Masked importance sampling (IcePop): a token whose rho leaves [low, high] is dropped from "
        "the loss (no gradient; the step's token count, the loss's denominator, is unchanged); 0 < low < 1 < high, "
        "e.g. [0.5, 2.0]; None: off.")

    @field_validator("mask_band")
    @classmethod
    def _band_brackets_one(cls, band: tuple[float, float] | None) -> tuple[float, float] | None:
        if band is not None and not 0 < band[0] < 1 < band[1]:
            raise ValueError(f"[{band[0]}, {band[1]}] must hold 0 < low < 1 < high (e.g. [0.5, 2.0]): a band that "
                             "leaves out ratio 1 drops the tokens on which engine and trainer agree")
        return band


class RunSpec(Strict):
    """The facts of one training run (a pool) that never change while it runs."""

    run_id: str = Field("swarmrl", min_length=1, max_length=128, description="Name of the run; manifests carry it.")
    model: str = Field("", max_length=256, description="What is being trained, in words (e.g. the base model's "
                       "name); shown to people joining the pool.")
    task: TaskSpec = Field(default_factory=TaskSpec, description="The task prompts are drawn from and scored by.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="How every rollout is sampled.")
    max_staleness: int = Field(2, ge=0, le=1_000_000, description="k: a group generated with a policy more than "
                               "k versions behind the reference version (the lease's, the coordinator's current "
                               "one, the trainer's) is refused or dropped; 0: synchronous on-policy.")
    proofs: ProofSpec = Field(default_factory=ProofSpec, description="Activation proofs rollouts must carry.")
    weights_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The dtype of the weights every checkpoint is published in (the trainer keeps fp32 "
        "master weights): float32 where nodes run on CPUs, bfloat16 where they run bf16 on GPUs (half the bytes, "
        "and far smaller deltas).")
    corrections: CorrectionSpec = Field(default_factory=CorrectionSpec, description="How the trainer corrects the "
                                        "engine/trainer probability gap (truncation, masking); off by default.")
    environment: EnvironmentSpec | None = Field(
        None, description="What answers the model's turns in a multi-turn run (`sampling.max_turns` > 1); nodes and "
        "the verifier run it, so it must replay (`protocol.episodes`). None: single-turn.")

    @model_validator(mode="after")
    def _episodes_have_an_environment(self) -> RunSpec:
        if self.sampling.max_turns > 1 and self.environment is None:
            raise ValueError("sampling.max_turns > 1 needs [run.environment] (name = an environment that answers "
                             "the model's turns)")
        if self.sampling.max_turns == 1 and self.environment is not None:
            raise ValueError("[run.environment] is set but sampling.max_turns is 1: set max_turns to the model turns "
                             "an episode may have")
        if self.sampling.in_flight_updates and (self.sampling.max_turns > 1 or self.max_staleness < 1):
            raise ValueError("sampling.in_flight_updates needs max_staleness >= 1 (a group then spans versions) and "
                             "sampling.max_turns = 1 (multi-turn episodes cannot change versions mid-episode)")
        return self

    def mismatch(self, expected: RunSpec) -> str | None:
        """Why this run is not the `expected` one (each differing field, both values), or None when equal."""
        mine, theirs = self.model_dump(mode="json"), expected.model_dump(mode="json")
        diffs = [f"{k}: the coordinator's is {mine[k]!r}, this role's config says {theirs[k]!r}"
                 for k in mine if mine[k] != theirs[k]]
        return "; ".join(diffs) or None


KIND_RUN = "run"
"""The kind of the coordinator's signature over the run description."""


def sign_spec(spec: RunSpec, coordinator: Identity, epoch: int = 0) -> Signature:
    """The coordinator's signature of `spec` for its pool (of store `epoch`): timeless, and the same every time it
    is made."""
    body = canonical_json(spec.model_dump(mode="json"))
    return sign(coordinator, KIND_RUN, pool_id(spec.run_id, coordinator.public_key_hex, epoch), body, ts=0.0,
                nonce=sha256_hex(body)[:32])


class RunInfo(Strict):
    """What GET /v1/info answers: the run description signed by the coordinator, its key, and what changes as it
    runs (the current version and the DHT peers, which are not signed: a node checks what it fetches by them)."""

    spec: RunSpec
    coordinator_key: str = Field(description="Ed25519 public key that signs manifests, leases and `spec`, hex.")
    spec_signature: Signature = Field(description="The coordinator's signature of `spec` (`sign_spec`).")
    current_version: int = Field(description="Newest published policy version; -1 before the first.")
    dht_peers: list[str] = Field(default_factory=list, description="libp2p multiaddrs to bootstrap the DHT.")
    epoch: int = Field(0, ge=0, lt=2**63, description="The epoch of the coordinator's store, drawn when it was made; "
                       "part of the pool's name, so `spec_signature` covers it.")

    @property
    def run_id(self) -> str:
        return self.spec.run_id

    @property
    def pool(self) -> str:
        """The pool every signature of this run names (`signing.pool_id`)."""
        return pool_id(self.spec.run_id, self.coordinator_key, self.epoch)

    @classmethod
    def signed(cls, spec: RunSpec, coordinator: Identity, current_version: int, dht_peers: list[str] | None = None,
               epoch: int = 0) -> RunInfo:
        return cls(spec=spec, coordinator_key=coordinator.public_key_hex,
                   spec_signature=sign_spec(spec, coordinator, epoch), current_version=current_version,
                   dht_peers=list(dht_peers or []), epoch=epoch)

    def verify(self, key: str | None = None) -> None:
        """SignatureError unless `spec` carries the signature of `key` (default: the key this info names) for this
        pool. A node passes the key it pinned, so a rewritten run description (or key) is refused."""
        key = (key or self.coordinator_key).lower()
        verify_signed(self.spec_signature, canonical_json(self.spec.model_dump(mode="json")), kind=KIND_RUN,
                      pool=pool_id(self.spec.run_id, key, self.epoch), key=key, max_skew_s=None)


def check_run(actual: RunSpec, expected: RunSpec | None, role: str) -> None:
    """Raise ValueError, saying what differs, when a role configured for run `expected` meets `actual`."""
    if expected is None:
        return
    why = actual.mismatch(expected)
    if why is not None:
        raise ValueError(f"the {role} is configured for another run than the coordinator's: {why}")

