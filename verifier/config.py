"""The verifier's config, and the tolerances of its checks with how they were calibrated."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from swarmrl.protocol import quarantine
from swarmrl.protocol.run import RunSpec
from swarmrl.transfer.p2p.config import P2PConfig


class Tolerances(BaseModel):
    """Thresholds of the full check. The field defaults are for float32 (both engines' default on the CPU); the
    verifier's dtype picks its set (`for_dtype`), and a config's `tolerances` fields override single values.

    The promise: in float32 every honest group passes with a margin (5.7x to 370x the worst honest error measured)
    and every group made with weights perturbed by 0.1% fails, on the models calibrated (bench/byzantine.py's
    calibration; the measurements and how each threshold follows from them are in bench/RESULTS.md, "Calibration
    (fp32, CPU)"). A larger model has larger fp32 noise: rerun the calibration for it. The bfloat16 values
    (`BF16_ESTIMATES`) are estimates, not yet measured on a GPU (bench/gpu_check.py measures them there).
    """

    model_config = ConfigDict(extra="forbid")

    logprob_abs: float = Field(5e-4, gt=0, description="Largest |claimed - recomputed| logprob per token.")
    tie_margin: float = Field(1e-3, ge=0, description="A token whose replay gap (protocol.sampling."
                                                      "replay_tokens) is within this is excused (near-tie); any "
                                                      "other token that is not the rule's sample fails.")
    proof_boundary_rel: float = Field(1e-3, ge=0, description="Proof entries within this relative margin of the "
                                                              "top-k boundary are not compared.")
    proof_max_ulp: float = Field(1.0, gt=0, description="Largest error of one compared proof entry, fp16 ulps.")
    proof_mean_ulp: float = Field(0.55, gt=0, description="Largest mean error over a group's compared proof "
                                                          "entries, fp16 ulps.")

    @classmethod
    def for_dtype(cls, dtype: str) -> Tolerances:
        """The thresholds for a recomputation in `dtype` ('float32', 'bfloat16', 'float16')."""
        return cls(**_DTYPE_TOLERANCES.get(dtype, {}))


BF16_ESTIMATES: dict[str, float] = {"logprob_abs": 5e-2, "tie_margin": 0.1, "proof_boundary_rel": 6e-2,
                                    "proof_max_ulp": 48.0, "proof_mean_ulp": 8.0}
"""bfloat16 thresholds: estimates, not measurements (see Tolerances); float16 uses them too until measured."""
_DTYPE_TOLERANCES: dict[str, dict[str, float]] = {"bfloat16": BF16_ESTIMATES, "float16": BF16_ESTIMATES}


class VerifierConfig(BaseModel):
    """Everything `swarmrl verifier` needs. Load from TOML with `runtime.config.load_config`."""

    model_config = ConfigDict(extra="forbid")

    coordinator_url: str = Field("http://127.0.0.1:8470", description="The coordinator to verify for.")
    coordinator_key: str | None = Field(None, description="Pinned coordinator public key (hex) that must sign "
                                                          "manifests; None trusts the key /v1/info reports.")
    key_path: Path = Field(Path("verifier.key"), description="Operator identity; its key must be in the "
                           "coordinator's operator_keys.")
    work_dir: Path = Field(Path("verifier-data"), description="Checkpoints fetched for checking are kept here.")
    run: RunSpec | None = Field(None, description="The run this verifier is meant for (the pool's [run] table); "
                                "when set, the verifier refuses to start against a coordinator whose run differs. "
                                "The task, staleness bound and proof parameters always come from the coordinator.")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Serve Prometheus metrics (swarmrl_verifier_*) "
                                     "on this port at /metrics; 0 or None: off.")
    metrics_host: str = Field("127.0.0.1", description="Interface the metrics port listens on (0.0.0.0: all).")
    batch: int = Field(64, ge=1, description="Pending groups claimed per poll.")
    poll_interval_s: float = Field(0.2, gt=0, description="Wait between polls when nothing is pending and the "
                                   "coordinator did not wait (long_poll_s = 0, or an error).")
    long_poll_s: float = Field(2.0, ge=0, le=10, description="Ask the coordinator to hold an empty poll this long "
                               "until a group is submitted, so a group is checked as soon as it arrives.")
    keep_versions: int = Field(3, ge=1, description="Policy versions kept loaded (at least the run's "
                                                     "max_staleness + 1 are).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype of the recomputation; its tolerances are the defaults (Tolerances.for_dtype). "
                               "A pool whose nodes run bf16 needs bf16 tolerances even with an fp32 verifier.")
    device: str = Field("cpu", description="Device of the recomputation (cpu, cuda).")
    max_batch_tokens: int = Field(16384, ge=64, description="Padded tokens per recomputation forward.")
    tolerances: Tolerances = Field(default_factory=Tolerances, description="Thresholds; see Tolerances. Fields "
                                   "not given take the defaults of `dtype` (Tolerances.for_dtype).")
    warmup_checks: int = Field(quarantine.WARMUP_CHECKS, ge=0, description="K: every group of a node is fully "
                               "checked until it passed K (protocol.quarantine; the bound in docs/quarantine.md).")
    sample_rate: float = Field(quarantine.SAMPLE_RATE, ge=0, le=1, description="p: after K passes, the share of "
                               "groups fully checked; the others are held until later checks vouch for them.")
    max_held: int = Field(quarantine.MAX_HELD, ge=0, description="h: a node holding this many groups gets its next "
                          "group fully checked (an overflow check, which vouches for nothing).")
    policy_seed: int | None = Field(None, description="Seed of the verifier's own random choices, such as the "
                                    "positions a full check samples (tests only); None: OS randomness. The p "
                                    "draws are the coordinator's (its draw_seed).")
    probe_tokens: int = Field(16, ge=1, description="Early exit: first, the prompt and this many completion tokens of "
                              "one rollout per group (chosen at random) are recomputed and checked; a group failing "
                              "there costs no more.")
    first_chunk_tokens: int = Field(16, ge=1, description="Then all rollouts are recomputed in chunks with the "
                                    "model's KV cache, checked after each: the first covers this many completion "
                                    "tokens, each next one `chunk_growth` times as many.")
    chunk_growth: int = Field(2, ge=1, description="Growth factor of the chunks (1: equal chunks).")
    logit_memory_mb: int = Field(256, ge=1, description="Logits are scored (replay, logprobs) this many MiB of "
                                 "float64 [positions, vocab] at a time, so long completions and large vocabularies "
                                 "stay in bounded memory.")
    identity_budget_s: float | None = Field(300.0, gt=0, description="Verifier seconds of full checks and reward "
                                            "computation (sandbox runs, answer parsing) one identity may use per "
                                            "`identity_budget_window_s` (a token bucket); over it, its "
                                            "groups are deferred: left pending, unclaimed for claim_ttl_s, not "
                                            "drawn. None: no budget.")
    identity_budget_window_s: float = Field(600.0, gt=0, description="Refill period of `identity_budget_s`.")
    source_budget_s: float | None = Field(1200.0, gt=0, description="The same, for all identities registered from "
                                          "one source (address) together, per `source_budget_window_s`: free "
                                          "identities from one machine share one budget. None: no budget.")
    source_budget_window_s: float = Field(600.0, gt=0, description="Refill period of `source_budget_s`.")
    p2p: P2PConfig | None = Field(
        None, description="Fetch policy versions from the checkpoint swarm too (and serve them to it), when the pool "
        "has one; None: from the coordinator's HTTP origin only.")

    def quarantine_rules(self) -> quarantine.Rules:
        return quarantine.Rules(warmup_checks=self.warmup_checks, sample_rate=self.sample_rate,
                                max_held=self.max_held)

    @model_validator(mode="before")
    @classmethod
    def _tolerances_of_dtype(cls, data: Any) -> Any:
        """Fill the tolerances from the dtype's defaults; fields given in the config win."""
        if isinstance(data, dict) and not isinstance(data.get("tolerances"), Tolerances):
            dtype = data.get("dtype", cls.model_fields["dtype"].default)
            given = data.get("tolerances") or {}
            data = {**data, "tolerances": {**Tolerances.for_dtype(dtype).model_dump(), **given}}
        return data
