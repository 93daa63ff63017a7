"""The trainer's configuration: one flat pydantic model, loadable with `runtime.config.load_config`.

    cfg = load_config(TrainerConfig, "trainer.toml", ["lr=1e-4", "batch_groups=16"])

Flat on purpose: every knob is one `key=value` override away. The loss knobs are handed to
`trainer.grpo` as a small `GRPOConfig` (see `TrainerConfig.grpo`), the way torchtitan gives each
component its own slice of the job config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from swarmrl.protocol.run import RunSpec
from swarmrl.trainer.grpo import GRPOConfig


class TrainerConfig(BaseModel):
    """Everything the trainer role needs to pull verified groups, train and publish checkpoints."""

    model_config = ConfigDict(extra="forbid")

    # -- where --------------------------------------------------------------------------------------
    coordinator_url: str = Field("http://127.0.0.1:8470", description="Base URL of the coordinator API.")
    key_path: Path = Field(
        Path("keys/trainer.key"),
        description="Ed25519 private key of the trainer; its public key must be in the coordinator's operator_keys. "
        "Made (and said so) when the file does not exist.",
    )
    state_dir: Path = Field(
        Path("runs/trainer"), description="Trainer states (weights, optimizer, version, cursor) are kept here."
    )
    init_checkpoint: Path | None = Field(
        None, description="HF checkpoint directory of the warm-started model; used when state_dir holds no state."
    )
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Serve Prometheus metrics (swarmrl_trainer_*) "
                                     "on this port at /metrics; 0 or None: off.")
    metrics_host: str = Field("127.0.0.1", description="Interface the metrics port listens on (0.0.0.0: all).")
    run: RunSpec | None = Field(None, description="The run this trainer is meant for (the pool's [run] table); when "
                                "set, the trainer refuses to start against a coordinator whose run differs.")
    check_engine: Literal["auto", "vllm", "torch", "off"] = Field(
        "auto", description="Before a fresh run publishes anything, probe init_checkpoint with this node engine at "
        "the run's temperature and replay it with the verifier's checks (swarmrl/compat.py); a model the trusted side "
        "cannot replay is refused in one line, so no node is ever banned for it. auto: vLLM where installed (what "
        "nodes run by default), else torch; off: no check (the demo checks before it starts the trainer).")

    # -- optimiser ----------------------------------------------------------------------------------
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate (1e-3 collapsed the tiny model).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this.")

    # -- batch and loss -----------------------------------------------------------------------------
    batch_groups: int = Field(32, ge=1, description="Groups (prompts x group_size rollouts) per optimizer step.")
    micro_batch_size: int = Field(
        0, ge=0, description="Sequences per forward/backward (gradient accumulation); 0 = the whole batch at once."
    )
    loss: GRPOConfig = Field(default_factory=GRPOConfig, description="Advantages and the clipped loss.")
    fill_with_informative: bool = Field(
        False,
        description="Keep pulling until batch_groups groups with non-zero advantage are in (DAPO's dynamic "
        "sampling); default: batch_groups fresh groups are taken and the zero-advantage ones among them skipped.",
    )

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
        "while each costs some CPU (measured in bench/RESULTS.md).",
    )
    full_every: int = Field(
        20, ge=1, description="Publish a full checkpoint at least every N versions, the versions between as deltas "
        "against the one before (transfer/delta.py: a receiver fetches what changed, a few percent of a bf16 "
        "checkpoint at RL learning rates, bench/RESULTS.md); 1: every version in full. Nodes need not know it: each "
        "delta names its base.",
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
