"""The trainer's configuration: one flat pydantic model, loadable with `runtime.config.load_config`.

    cfg = load_config(TrainerConfig, "trainer.toml", ["lr=1e-4", "max_staleness=0"])

Flat on purpose: every knob is one `key=value` override away. The loss knobs are handed to
`trainer.grpo` as a small `GRPOConfig` (see `TrainerConfig.grpo`), the way torchtitan gives each
component its own slice of the job config.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from swarmrl.protocol.tasks import TaskSpec
from swarmrl.trainer.grpo import GRPOConfig


class TrainerConfig(BaseModel):
    """Everything the trainer role needs to pull verified groups, train and publish checkpoints."""

    model_config = ConfigDict(extra="forbid")

    # -- where --------------------------------------------------------------------------------------
    coordinator_url: str = Field("http://127.0.0.1:8470", description="Base URL of the coordinator API.")
    key_path: str = Field(
        "keys/trainer.key",
        description="Ed25519 private key of the trainer (made on first start); the coordinator must trust it.",
    )
    state_dir: str = Field(
        "runs/trainer", description="Trainer states (weights, optimizer, version, cursor) are kept here."
    )
    init_checkpoint: str | None = Field(
        None, description="HF checkpoint directory of the warm-started model; used when state_dir holds no state."
    )
    run_id: str = Field("", description="Run id for manifests; empty = take the coordinator's.")
    task: TaskSpec | None = Field(None, description="Task for evaluation (name, options); None = the coordinator's.")

    # -- optimiser ----------------------------------------------------------------------------------
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate (1e-3 collapsed the tiny model).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this.")

    # -- batch and staleness ------------------------------------------------------------------------
    batch_groups: int = Field(32, ge=1, description="Groups (prompts x group_size rollouts) per optimizer step.")
    micro_batch_size: int = Field(
        0, ge=0, description="Sequences per forward/backward (gradient accumulation); 0 = the whole batch at once."
    )
    max_staleness: int = Field(
        2, ge=0, description="k: train on groups sampled by versions >= current - k; 0 = synchronous on-policy."
    )

    # -- loss ---------------------------------------------------------------------------------------
    clip_low: float = Field(0.2, ge=0, lt=1, description="Ratio clipped below at 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="Ratio clipped above at 1 + clip_high.")
    clip_ratio_max: float = Field(
        4.0, gt=1, description="INTELLECT-2 two-sided cap: for negative advantages the ratio counts at most this."
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL to the initial model; 0 = no reference.")
    filter_zero_advantage: bool = Field(
        True, description="Skip groups whose rewards are all equal; they carry no signal (counted, not trained)."
    )
    fill_with_informative: bool = Field(
        False,
        description="Keep pulling until batch_groups groups with non-zero advantage are in (DAPO's dynamic "
        "sampling); default: batch_groups fresh groups are taken and the zero-advantage ones among them skipped.",
    )
    adv_eps: float = Field(1e-4, gt=0, description="Advantage = (r - mean) / (std + adv_eps) within a group.")

    # -- schedule -----------------------------------------------------------------------------------
    max_steps: int = Field(200, ge=0, description="Stop after this many optimizer steps (counted across restarts).")
    eval_every: int = Field(
        25, ge=0, description="Greedy exact match on the task's held-out set every N steps (and at step 0); 0 = never."
    )
    eval_size: int = Field(500, ge=1, description="How many held-out problems to evaluate (the task has 500).")
    poll_interval_s: float = Field(0.5, gt=0, description="Sleep between coordinator polls when no group is ready "
                                   "and the coordinator did not wait (long_poll_s = 0, or an error).")
    long_poll_s: float = Field(2.0, ge=0, le=10, description="Ask the coordinator to hold a poll that finds no new "
                               "group this long until one is accepted, so a step starts as soon as its batch is in.")
    shard_mb: float = Field(
        2.0, gt=0, description="Size of the content-addressed shards that checkpoints are cut into for nodes to "
        "exchange, MiB. A node shares a shard only once it holds all of it, so smaller shards spread sooner, "
        "while each costs some CPU (bench/RESULTS.md, N=8 nodes on 2 cores: at 100 Mbit/s 2 MiB took 22 s, "
        "4 MiB 24.5 s and 1 MiB 23 s with the CPU full; at 25 Mbit/s 1 MiB took 83 s, 4 MiB 95 s).",
    )
    publish_in_background: bool = Field(
        True, description="Upload and publish checkpoints on a background thread while training goes on."
    )
    keep_states: int = Field(3, ge=1, description="Keep this many newest states/checkpoints on disk.")
    seed: int = Field(0, description="Seeds torch and Python RNGs at a fresh start (restored on resume).")
    device: str = Field(
        "cpu", description="'cpu', 'cuda' (under torchrun: the rank's LOCAL_RANK GPU) or 'auto' (cuda if available)."
    )
    threads: int = Field(1, ge=0, description="torch.set_num_threads in the trainer; 0 = leave torch's default.")
    progress: bool = Field(True, description="Show a live rich progress line (rank 0 only).")

    def grpo(self, temperature: float = 1.0) -> GRPOConfig:
        """The loss's slice of this config. `temperature` is the sampler's (the coordinator's SamplingSpec)."""
        return GRPOConfig(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            clip_ratio_max=self.clip_ratio_max,
            kl_coef=self.kl_coef,
            temperature=temperature,
            filter_zero_advantage=self.filter_zero_advantage,
            adv_eps=self.adv_eps,
        )
