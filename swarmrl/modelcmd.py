"""`swarmrl model`: build the tiny model, warm it up to a target accuracy, save it in HF layout."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from rich.console import Console

from swarmrl.protocol.tasks import TaskSpec, load_task
from swarmrl.trainer.model import ModelConfig, build_model, build_tokenizer, save_checkpoint
from swarmrl.trainer.warmup import WarmupConfig, warm_start


def build_and_warm(out: Path, target_accuracy: float = 0.25, seed: int = 0, task: TaskSpec | None = None,
                   console: Console | None = None) -> float:
    """Write a warm-started checkpoint to `out`; returns its greedy accuracy on the held-out set."""
    console = console or Console()
    torch.set_num_threads(1)
    spec = task or TaskSpec()
    task = load_task(spec)
    tok = build_tokenizer()
    model = build_model(ModelConfig(seed=seed), tok)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(f"[bold]model[/] Llama, {n_params / 1e6:.2f}M parameters; warm start to accuracy "
                  f">= {target_accuracy:.2f}")
    t0 = time.time()
    with console.status("warm start") as status:
        def on_eval(step: int, loss: float, acc: float) -> None:
            status.update(f"warm start: step {step}, loss {loss:.3f}, held-out accuracy {acc:.3f}")

        acc = warm_start(model, tok, task, WarmupConfig(target_accuracy=target_accuracy, seed=seed), on_eval)
    save_checkpoint(model, tok, out, meta={"warmup_accuracy": acc, "task": spec.model_dump()})
    console.print(f"[bold]model[/] warm start done in {time.time() - t0:.0f} s: accuracy {acc:.3f} -> {out}")
    return acc
