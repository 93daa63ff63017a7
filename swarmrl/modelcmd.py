"""`swarmrl model`: build a checkpoint of any supported architecture and size, optionally warmed up on a task.

    swarmrl model ckpt/                                         # the tiny adder, warm-started (the demo's model)
    swarmrl model ckpt/ --arch qwen2 --size small30m --tokenizer bpe   # ~30M random Qwen2, BPE + ChatML

Operators and tests use it to try every path (both engines, the verifier, the trainer) without a model hub.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import torch
from rich.console import Console

from swarmrl.models.build import ModelConfig, build_model, count_parameters, save_checkpoint
from swarmrl.models.tokenizers import build_bpe_tokenizer, build_char_tokenizer
from swarmrl.protocol.tasks import TaskSpec, load_task
from swarmrl.trainer.warmup import WarmupConfig, warm_start

DEFAULT_BPE_VOCAB = 8192
CHAR_WARMUP_ACCURACY = 0.25
"""The addition adder's warm start target when none is given (char tokenizer only)."""


def build_checkpoint(out: Path, cfg: ModelConfig, tokenizer: Literal["char", "bpe"] = "char",
                     bpe_vocab: int = DEFAULT_BPE_VOCAB, warmup_accuracy: float | None = None,
                     task: TaskSpec | None = None, console: Console | None = None) -> dict[str, Any]:
    """Build `cfg` with a `tokenizer` ("char": the addition alphabet; "bpe": a byte-level BPE of `bpe_vocab`
    tokens trained here), warm it up on `task` (default: addition) until `warmup_accuracy` when that is > 0
    (None: 0.25 for the char tokenizer, no warm start for BPE), save it to `out`; returns what was built (also in
    swarmrl.json)."""
    console = console or Console()
    torch.set_num_threads(1)
    tok = build_char_tokenizer() if tokenizer == "char" else build_bpe_tokenizer(bpe_vocab, seed=cfg.seed)
    model = build_model(cfg, tok)
    n_params = count_parameters(model)
    meta: dict[str, Any] = {"arch": cfg.arch, "parameters": n_params, "tokenizer": tokenizer, "vocab": len(tok),
                            "model": cfg.model_dump()}
    console.print(f"[bold]model[/] {type(model).__name__}, {n_params / 1e6:.2f}M parameters, {tokenizer} tokenizer "
                  f"of {len(tok)} tokens")
    target = warmup_accuracy if warmup_accuracy is not None else (CHAR_WARMUP_ACCURACY if tokenizer == "char" else 0)
    if target > 0:
        spec = task or TaskSpec()
        loaded = load_task(spec)
        console.print(f"[bold]model[/] warm start on {spec.name} to accuracy >= {target:.2f}")
        t0 = time.time()
        try:
            with console.status("warm start") as status:
                def on_eval(step: int, loss: float, acc: float) -> None:
                    status.update(f"warm start: step {step}, loss {loss:.3f}, held-out accuracy {acc:.3f}")

                acc = warm_start(model, tok, loaded, WarmupConfig(target_accuracy=target, seed=cfg.seed), on_eval)
        finally:
            loaded.close()
        meta |= {"warmup_accuracy": acc, "task": spec.model_dump()}
        console.print(f"[bold]model[/] warm start done in {time.time() - t0:.0f} s: accuracy {acc:.3f}")
    save_checkpoint(model, tok, out, meta=meta)
    console.print(f"[bold]model[/] -> {out}")
    return meta


def build_and_warm(out: Path, target_accuracy: float = CHAR_WARMUP_ACCURACY, seed: int = 0,
                   task: TaskSpec | None = None, console: Console | None = None) -> float:
    """The demo's model: the tiny Llama with the character tokenizer, warm-started on `task` (default: addition);
    returns its greedy accuracy on the held-out set."""
    meta = build_checkpoint(out, ModelConfig(seed=seed), "char", warmup_accuracy=target_accuracy, task=task,
                            console=console)
    return float(meta.get("warmup_accuracy", 0.0))
