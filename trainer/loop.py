"""The trainer role: pull verified groups, take GRPO steps, publish every new policy version.

    cfg = load_config(TrainerConfig, "trainer.toml")
    run_trainer(cfg)                      # one process
    torchrun --nproc-per-node 2 -m ...    # the same call under FSDP: rank 0 talks to the coordinator

One step:
  1. collect `batch_groups` trainable groups with group_id > cursor. A group sampled by a policy more than
     `max_staleness` versions behind the trainer's is dropped (counted as stale); a zero-advantage group is
     skipped (counted as filtered); the cursor moves past both. The time spent here is `trainer_idle_s`.
  2. one optimizer step (FSDP: every rank its slice);
  3. version += 1; save the state (weights in HF layout, optimizer, version, cursor, the group ids trained on and
     passed over) atomically, log the step (`steps.jsonl`), then acknowledge the cursor to the coordinator
     (reading the feed moves nothing there; the acknowledgement frees the backpressure buffer);
  4. hand the new weights to the background publisher, which uploads and publishes them while training
     goes on: the trainer never waits for a broadcast;
  5. post metrics (and every `eval_every` steps the held-out greedy accuracy).

Versions are monotonic across restarts: a restarted trainer takes the newest of its saved version and the
coordinator's, and only publishes above the coordinator's.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from swarmrl.models.prompts import pad_token_id
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.messages import RunInfo
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.protocol.run import RunSpec, check_run
from swarmrl.protocol.tasks import load_task
from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.runtime.errors import UserError
from swarmrl.runtime.operator import not_an_operator, operator_identity, wait_for_coordinator
from swarmrl.trainer.collect import TrainerClient, collect_groups
from swarmrl.trainer.config import TrainerConfig
from swarmrl.trainer.distributed import (
    DistEnv,
    all_reduce_int,
    broadcast_object,
    fsdp_grpo_step,
    full_state,
    init_distributed,
    load_optimizer_state,
    optimizer_state,
    resolve_device,
    shard_model,
    unsharded_copy,
)
from swarmrl.trainer.evaluate import correct_count, run_episodes
from swarmrl.trainer.exporter import TrainerExporter
from swarmrl.trainer.grpo import build_batch, make_optimizer
from swarmrl.trainer.metrics import StepDisplay, elapsed_s, rollout_metrics, staleness_histogram
from swarmrl.trainer.model import load_checkpoint
from swarmrl.trainer.publisher import Publisher
from swarmrl.trainer.state import (
    TrainerState,
    append_step_log,
    clean_temp,
    latest,
    load_state,
    prune_states,
    reconcile_step_log,
    restore_rng,
    save_state,
)

log = logging.getLogger(__name__)

ModelCheck = Callable[[Path, RunSpec], "str | None"]  # why a checkpoint cannot be replayed (swarmrl.compat), or None


# -- 2. the run -------------------------------------------------------------------------------------


@dataclass
class TrainerSummary:
    """What `run_trainer` did (rank 0's view)."""

    step: int
    version: int
    cursor: int
    state_path: Path | None
    history: list[dict[str, float]] = field(default_factory=list)
    """The metrics posted, one dict per report (step 0's evaluation included), with `step`/`version`."""


def run_trainer(cfg: TrainerConfig, *, client: TrainerClient | None = None, stop: threading.Event | None = None,
                display: bool | None = None, check_model: ModelCheck | None = None) -> TrainerSummary:
    """Train until `cfg.max_steps` (counted across restarts) or until `stop` is set; returns a summary.

    Resumes from the newest state in `cfg.state_dir` if there is one, else starts from
    `cfg.init_checkpoint`. `client` defaults to a signed `CoordinatorClient` for `cfg.coordinator_url`
    with the identity at `cfg.key_path`. Under torchrun every rank calls this; only rank 0 talks to the
    coordinator, writes states and publishes. Returns after the last checkpoint is published. `check_model`: a
    line it says of `init_checkpoint` before a fresh start publishes anything refuses the run."""
    joined = dist.is_available() and dist.is_initialized()
    env = init_distributed(cfg.device)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    # transformers draws a progress bar for every load and save: one per step here, which buries the status.
    transformers.utils.logging.disable_progress_bar()
    pub_client: TrainerClient | None = client
    owned: list[CoordinatorClient] = []
    identity: Identity | None = None
    if env.is_main and client is None:
        identity = operator_identity(cfg.key_path, "trainer")
        wait_for_coordinator(cfg.coordinator_url, "trainer", stop)
        # Two connections: the publisher thread uploads while the main thread polls for groups.
        client = CoordinatorClient(cfg.coordinator_url, identity)
        pub_client = CoordinatorClient(cfg.coordinator_url, identity)
        owned = [client, pub_client]
    try:
        if identity is not None:  # a signed read that moves nothing: a key the coordinator does not list is said now
            client.training_batch(after_id=0, limit=1)  # type: ignore[union-attr]
        return _Run(cfg, env, client, pub_client, stop, cfg.progress if display is None else display, check_model).run()
    except CoordinatorError as e:
        if identity is not None and e.code is RefusalCode.NOT_OPERATOR:  # the coordinator does not list the key
            raise not_an_operator("trainer", cfg.key_path, identity, cfg.coordinator_url) from e
        raise
    finally:
        for c in owned:
            c.close()
        if env.distributed and not joined:  # we made the process group, so we take it down
            dist.destroy_process_group()


class _Run:
    """The state of one `run_trainer` call; its methods are the steps above, in order."""

    def __init__(self, cfg: TrainerConfig, env: DistEnv, client: TrainerClient | None,
                 pub_client: TrainerClient | None, stop: threading.Event | None, display: bool,
                 check_model: ModelCheck | None = None):
        self.cfg, self.env, self.client, self.stop = cfg, env, client, stop
        self.state_dir = Path(cfg.state_dir)
        self.history: list[dict[str, float]] = []
        self.t_ready = time.monotonic()
        self.eval_total_s = 0.0  # seconds spent in held-out evaluations

        # The run: rank 0 asks, everyone hears.
        info: RunInfo = broadcast_object(client.info() if env.is_main else None, env)  # type: ignore[union-attr]
        try:
            check_run(info.spec, cfg.run, "trainer")
        except ValueError as e:
            raise UserError(f"{e}: remove the trainer's [run] table, or point it at that run's coordinator") from None
        self.info = info
        self.run_id = info.run_id
        self.task, self.episodes = load_task(info.spec.task), run_episodes(info.spec)
        self.max_staleness = info.spec.max_staleness
        self.temperature = info.spec.sampling.temperature

        # Weights, optimizer and counters: from the newest state, else from the warm-started checkpoint.
        if env.is_main:
            clean_temp(self.state_dir)
        path: Path | None = broadcast_object(latest(self.state_dir) if env.is_main else None, env)
        loaded = load_state(path) if path is not None else None
        if env.is_main:
            reconcile_step_log(self.state_dir, loaded.state if loaded is not None else None)
        self.skipped_since_save: list[int] = []  # consumed without a step (zero advantage): logged with the next
        if loaded is not None:
            if loaded.state.run_id and loaded.state.run_id != self.run_id:
                raise UserError(f"the state in {path} belongs to run {loaded.state.run_id!r}, the coordinator runs "
                                f"{self.run_id!r}: give this run its own state_dir")
            self.model, self.tokenizer, self.ts = loaded.model, loaded.tokenizer, loaded.state
            restore_rng(loaded.rng)
        else:
            if not cfg.init_checkpoint:
                raise UserError(f"no trainer state in {self.state_dir} and no init_checkpoint to start from: set "
                                "init_checkpoint to a checkpoint directory (`swarmrl model DIR` makes one)")
            if not (cfg.init_checkpoint / "config.json").is_file():  # never a model hub's name: a directory here
                raise UserError(f"init_checkpoint {cfg.init_checkpoint.absolute()} is not a checkpoint directory (no "
                                "config.json): fix init_checkpoint (`swarmrl model DIR` makes one)")
            if env.is_main and check_model is not None and (problem := check_model(cfg.init_checkpoint, info.spec)):
                raise UserError(f"the run is refused before it starts: {problem}. Nothing was published: use a model "
                                "this install can replay (README: Models)")
            self.model, self.tokenizer = load_checkpoint(cfg.init_checkpoint)
            self.ts = TrainerState(run_id=self.run_id)
            torch.manual_seed(cfg.seed)
            random.seed(cfg.seed)
        self.ref_model = None
        if cfg.loss.kl_coef > 0:
            if not cfg.init_checkpoint:
                raise ValueError("kl_coef > 0 needs init_checkpoint (the reference policy)")
            self.ref_model, _ = load_checkpoint(cfg.init_checkpoint)
            self.ref_model.requires_grad_(False)
            self.ref_model.eval()
        self.device = resolve_device(cfg.device)
        self.model.to(self.device)
        if self.ref_model is not None:
            self.ref_model.to(self.device)
        if env.distributed:
            shard_model(self.model)
            if self.ref_model is not None:
                shard_model(self.ref_model)
        self.optimizer = make_optimizer(self.model, cfg.lr, cfg.betas, cfg.weight_decay)
        if loaded is not None:
            load_optimizer_state(self.model, self.optimizer, loaded.optimizer)
            for g in self.optimizer.param_groups:  # the config, not the saved state, says how to go on
                g.update(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.state_path = path
        self.resumed = loaded is not None

        # Versions never go backwards, even if our state is older than what the coordinator has.
        if info.current_version > self.ts.version:
            log.warning("coordinator is at version %d, our state at %d: continuing above the coordinator's",
                        info.current_version, self.ts.version)
            self.ts.version = info.current_version
        self.publisher = Publisher(pub_client, self.run_id, background=cfg.publish_in_background,
                                   shard_size=int(cfg.shard_mb * (1 << 20)), dtype=info.spec.weights_dtype,
                                   full_every=cfg.full_every, work_dir=self.state_dir) if env.is_main else None
        self.display = StepDisplay(cfg.max_steps, self.ts.step, enabled=display and env.is_main)
        self.exporter = TrainerExporter() if env.is_main else None

    # -- collectives (every rank calls these) --------------------------------------------------------

    def save(self) -> Path | None:
        """Write the current state (rank 0); returns its directory on rank 0."""
        if self.env.distributed:
            msd, osd = full_state(self.model, self.optimizer, self.env)
            if not self.env.is_main:
                return None
            model = unsharded_copy(self.model, msd)
        else:
            model = self.model
            osd = optimizer_state(self.model, self.optimizer)
        self.ts.run_id = self.run_id
        return save_state(self.state_dir, model, self.tokenizer, osd, self.ts)  # type: ignore[arg-type]

    def evaluate(self) -> float:
        """Greedy exact match on the task's held-out problems, as `trainer.evaluate.accuracy` measures it
        (FSDP: each rank a share, summed)."""
        t0 = time.monotonic()
        problems = list(self.task.eval_set()[: self.cfg.eval_size])
        mine = problems[self.env.rank :: self.env.world_size]
        correct = correct_count(self.model, self.tokenizer, mine, self.task, self.env.distributed, self.episodes)
        acc = all_reduce_int(correct, self.env) / max(len(problems), 1)
        self.eval_total_s += time.monotonic() - t0
        return acc

    # -- rank 0 only ---------------------------------------------------------------------------------

    def report(self, metrics: dict[str, float]) -> None:
        # train_clock_s: seconds since setup ended, evaluations excluded (how bench/trl_baseline.py times TRL).
        train_clock_s = time.monotonic() - self.t_ready - self.eval_total_s
        metrics = {**metrics, "elapsed_s": elapsed_s(), "train_clock_s": train_clock_s,
                   "eval_total_s": self.eval_total_s}
        record = {"step": float(self.ts.step), "version": float(self.ts.version), **metrics}
        self.history.append(record)
        if self.exporter is not None:
            self.exporter.observe(self.ts.step, self.ts.version, metrics)
        try:
            self.client.metrics(self.ts.step, self.ts.version, metrics)  # type: ignore[union-attr]
        except Exception as e:  # metrics are not worth stopping training for
            log.warning("posting metrics failed: %s", e)

    def acknowledge(self, cursor: int) -> None:
        """Tell the coordinator that a saved state has consumed the feed up to `cursor`. Acknowledgements are
        cumulative, so a failed one is made good by the next."""
        try:
            self.client.ack(cursor)  # type: ignore[union-attr]
        except Exception as e:  # not worth stopping training for: only backpressure waits on it
            log.warning("acknowledging feed cursor %d failed: %s", cursor, e)

    def ensure_published(self) -> None:
        """Publish our current weights now, synchronously: the coordinator lacks them (or has nothing yet)."""
        if self.state_path is None:  # fresh start: the initial weights get a state of their own
            self.state_path = self.save()
        if self.env.is_main:
            assert self.publisher is not None and self.state_path is not None
            self.publisher.submit(self.state_path / "model", self.ts.version)
            self.publisher.flush()
            if self.publisher.published_version < self.ts.version:
                err = self.publisher.last.error if self.publisher.last else "unknown"
                raise RuntimeError(f"could not publish the initial version {self.ts.version}: {err}")

    # -- the loop ------------------------------------------------------------------------------------

    def run(self) -> TrainerSummary:
        cfg, env = self.cfg, self.env
        server = self.exporter.serve(cfg.metrics_host, cfg.metrics_port) if self.exporter is not None else None
        try:
            # Identical on every rank (all saw the same info), so the collectives inside match up.
            # The training clock starts here, setup done (the initial publish counts: nodes wait for it).
            self.t_ready = time.monotonic()
            needs_publish = self.info.current_version < self.ts.version or self.info.current_version < 0
            if needs_publish:
                self.ensure_published()
            if env.is_main and self.resumed and self.ts.cursor > 0:
                self.acknowledge(self.ts.cursor)  # a state saved just before a crash may not have been acknowledged
            if self.ts.step == 0 and cfg.eval_every > 0:
                acc = self.evaluate()
                if env.is_main:
                    self.display.print(f"step 0 (v{self.ts.version}): eval accuracy {acc:.3f}")
                    self.report({"eval_accuracy": acc})
            with self.display:
                while self.ts.step < cfg.max_steps:
                    if not self.train_one_step():
                        break
            if env.distributed:  # rank 0 may still be reporting: leave together, so teardown is orderly
                dist.barrier()
        finally:
            if self.publisher is not None:
                self.publisher.close()
            if server is not None:
                server.close()
        return TrainerSummary(self.ts.step, self.ts.version, self.ts.cursor, self.state_path, self.history)

    def train_one_step(self) -> bool:
        """Collect, step, save, publish, report. False when stopped while waiting for groups."""
        cfg, env, ts = self.cfg, self.env, self.ts
        collected = None
        if env.is_main:
            collected = collect_groups(
                self.client, ts.cursor, ts.version, cfg, self.max_staleness, self.stop,  # type: ignore[arg-type]
                pool=self.info.pool,
                on_wait=lambda n: self.display.status(f"v{ts.version}: waiting for groups ({n}/{cfg.batch_groups})"))
        groups = broadcast_object(None if collected is None else collected.groups, env)
        if groups is None:
            return False
        if not groups:  # every fresh group had zero advantage: nothing to learn, no new version
            ts.cursor = broadcast_object(collected.cursor if collected else None, env)
            if env.is_main:
                assert collected is not None
                self.skipped_since_save += collected.consumed
                # Nothing to save: the saved state (the same weights) would skip these groups again after a restart,
                # so they are consumed. Acknowledging them now keeps a run of such groups from filling the buffer.
                self.acknowledge(ts.cursor)
                self.display.print(f"v{ts.version}: no step: all {len(collected.fresh)} fresh groups had zero "
                                   "advantage (no spread in reward within any group)")
            return True
        used_version = ts.version

        t0 = time.monotonic()
        batch = build_batch(groups, pad_token_id(self.tokenizer), cfg.loss.adv_eps)
        stats = fsdp_grpo_step(self.model, self.optimizer, batch, cfg.loss, env, temperature=self.temperature,
                               grad_clip=cfg.grad_clip, micro_batch_size=cfg.micro_batch_size,
                               ref_model=self.ref_model, correction=self.info.spec.corrections)
        step_s = time.monotonic() - t0

        ts.step += 1
        ts.version += 1
        ts.cursor = broadcast_object(collected.cursor if collected else None, env)
        if env.is_main:
            assert collected is not None
            ts.trained = [g.group_id for g in groups]
            trained = set(ts.trained)
            ts.skipped = self.skipped_since_save + [i for i in collected.consumed if i not in trained]
        t1 = time.monotonic()
        path = self.save()
        save_s = time.monotonic() - t1
        if env.is_main:
            assert path is not None and self.publisher is not None
            append_step_log(self.state_dir, ts)  # after the state: a kill in between is mended at start
            self.skipped_since_save = []
            self.state_path = path
            self.acknowledge(ts.cursor)  # the state that consumed the feed up to the cursor is on disk
            self.publisher.submit(path / "model", ts.version)  # returns at once: training goes on

        eval_acc = None
        if cfg.eval_every > 0 and ts.step % cfg.eval_every == 0:
            eval_acc = self.evaluate()

        if env.is_main:
            assert collected is not None and self.publisher is not None
            metrics: dict[str, float] = {
                **rollout_metrics(collected.fresh),
                **{k: v for k, v in stats.items()},
                **staleness_histogram(collected.groups, used_version, self.max_staleness),
                "trainer_idle_s": collected.idle_s,
                "step_s": step_s,
                "save_s": save_s,
                "groups_used": float(len(collected.groups)),
                "groups_stale": float(collected.stale),
                "groups_filtered": float(collected.filtered),
                "published_version": float(self.publisher.published_version),
            }
            last = self.publisher.last
            if last is not None:
                metrics["publish_s"] = last.seconds
                if last.error is None:  # what each receiver fetched for that version, against the full checkpoint
                    metrics.update(publish_version=float(last.version), publish_bytes=float(last.sent_bytes),
                                   publish_full_bytes=float(last.full_bytes))
            if eval_acc is not None:
                metrics["eval_accuracy"] = eval_acc
                self.display.print(f"step {ts.step} (v{ts.version}): eval accuracy {eval_acc:.3f}")
            self.report(metrics)
            self.display.step(ts.step, ts.version, metrics)
            prune_states(self.state_dir, cfg.keep_states, protect=self.publisher.in_use())
        return True
