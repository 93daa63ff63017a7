"""`swarmrl model`: build a checkpoint of any supported architecture and size, optionally warmed up on a task.

    swarmrl model ckpt/                                         # the tiny adder, warm-started (the demo's model)
    swarmrl model ckpt/ --arch qwen2 --size small30m --tokenizer bpe   # ~30M random Qwen2, BPE + ChatML

Operators and tests use it to try every path (both engines, the verifier, the trainer) without a model hub. A local
swarm (`swarmrl demo`) builds its model from the same recipe (`ModelRecipe`), or starts from a checkpoint
directory, and warms it up with `warm_and_save`.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from swarmrl.models.build import ModelConfig, build_model, count_parameters, save_checkpoint
from swarmrl.models.tokenizers import build_bpe_tokenizer, build_char_tokenizer
from swarmrl.protocol.tasks import Task, TaskSpec, load_task
from swarmrl.trainer.evaluate import Episodes
from swarmrl.trainer.warmup import WarmupConfig, warm_start

DEFAULT_BPE_VOCAB = 8192
CHAR_WARMUP_ACCURACY = 0.25
"""The addition adder's warm start target when none is given (char tokenizer only)."""
TASK_CORPUS_PROBLEMS = 5000
"""Training problems drawn for a BPE trained on the task's text."""


class ModelRecipe(BaseModel):
    """A model to build, as `swarmrl model` builds it: architecture, size, tokenizer. The defaults are the addition
    demo's 0.86M Llama with the character tokenizer."""

    model_config = ConfigDict(extra="forbid")

    arch: str = Field("llama", description="Architecture: llama, qwen2, qwen3, mistral, phi3, gemma2, gpt2, opt.")
    size: str = Field("tiny", description="Preset size: tiny (the 0.86M adder), mini, small30m.")
    shape: dict[str, Any] = Field(default_factory=dict, description="models.build.ModelConfig fields over the "
                                  "preset's, e.g. {num_layers = 4, max_positions = 256}.")
    tokenizer: Literal["char", "bpe"] = Field("char", description="char: the addition alphabet; bpe: a byte-level "
                                              "BPE trained here, with a ChatML chat template and two stop tokens.")
    bpe_vocab: int = Field(DEFAULT_BPE_VOCAB, ge=259, description="BPE vocabulary size.")
    bpe_corpus: Literal["generic", "task"] = Field(
        "generic", description="What the BPE is trained on: a generated generic corpus, or the run's task "
        f"({TASK_CORPUS_PROBLEMS} training problems drawn: prompts and reference solutions).")
    individual_digits: bool = Field(False, description="BPE: every digit a token of its own (as Qwen's tokenizers).")

    def model_config_for(self, seed: int) -> ModelConfig:
        """The ModelConfig this recipe builds with `seed`."""
        return ModelConfig.preset(self.size, arch=self.arch, **{**self.shape, "seed": seed})


def make_tokenizer(kind: Literal["char", "bpe"], bpe_vocab: int = DEFAULT_BPE_VOCAB, seed: int = 0,
                   texts: list[str] | None = None, individual_digits: bool = False) -> PreTrainedTokenizerFast:
    """The character tokenizer, or a BPE of `bpe_vocab` tokens trained on `texts` (None: the generic corpus)."""
    if kind == "char":
        return build_char_tokenizer()
    return build_bpe_tokenizer(bpe_vocab, seed=seed, texts=texts, individual_digits=individual_digits)


def task_texts(task: Task, seed: int, n: int = TASK_CORPUS_PROBLEMS) -> list[str]:
    """Text of `n` training problems of `task` (prompt, then the reference solution when there is one)."""
    rng = random.Random(seed)
    return [p.prompt if p.solution is None else "\n".join((p.prompt, *(p.solution_turns or (p.solution,))))
            for p in (task.sample(rng) for _ in range(n))]


def build_from_recipe(recipe: ModelRecipe, seed: int, task: Task | None = None
                      ) -> tuple[PreTrainedModel, PreTrainedTokenizerFast, dict[str, Any]]:
    """(model, tokenizer, what was built) for `recipe`; `task` is needed when the BPE is trained on its text."""
    if recipe.tokenizer == "bpe" and recipe.bpe_corpus == "task" and task is None:
        raise ValueError("a BPE trained on the task's text needs the task")
    torch.set_num_threads(1)
    texts = task_texts(task, seed) if recipe.tokenizer == "bpe" and recipe.bpe_corpus == "task" and task else None
    cfg = recipe.model_config_for(seed)
    tok = make_tokenizer(recipe.tokenizer, recipe.bpe_vocab, seed, texts, recipe.individual_digits)
    model = build_model(cfg, tok)
    meta: dict[str, Any] = {"arch": cfg.arch, "parameters": count_parameters(model), "tokenizer": recipe.tokenizer,
                            "vocab": len(tok), "model": cfg.model_dump()}
    return model, tok, meta


def warm_and_save(model: PreTrainedModel, tok: PreTrainedTokenizerBase, out: Path, meta: dict[str, Any],
                  task: Task | None, warmup: WarmupConfig, console: Console, seed: int = 0,
                  episodes: Episodes | None = None) -> dict[str, Any]:
    """Warm `model` up on `task` when `warmup.target_accuracy` > 0 (with `episodes`: on its reference episodes),
    then save it (and `meta`, with the warm start's accuracy) to `out`; `seed` draws the warm start's problems.
    Returns the meta written to swarmrl.json."""
    if warmup.target_accuracy > 0:
        assert task is not None, "a warm start needs a task"
        console.print(f"[bold]model[/] warm start on {task.name} to accuracy >= {warmup.target_accuracy:.2f}")
        t0 = time.time()
        with console.status("warm start") as status:
            def on_eval(step: int, loss: float, acc: float) -> None:
                status.update(f"warm start: step {step}, loss {loss:.3f}, held-out accuracy {acc:.3f}")

            acc = warm_start(model, tok, task, warmup, on_eval, seed, episodes)
        meta = {**meta, "warmup_accuracy": acc}
        console.print(f"[bold]model[/] warm start done in {time.time() - t0:.0f} s: accuracy {acc:.3f}")
    save_checkpoint(model, tok, out, meta=meta)
    console.print(f"[bold]model[/] saved to {out} (weights, tokenizer and swarmrl.json)")
    return meta


def build_checkpoint(out: Path, cfg: ModelConfig, tokenizer: Literal["char", "bpe"] = "char",
                     bpe_vocab: int = DEFAULT_BPE_VOCAB, warmup_accuracy: float | None = None,
                     task: TaskSpec | None = None, console: Console | None = None) -> dict[str, Any]:
    """Build `cfg` with a `tokenizer` ("char": the addition alphabet; "bpe": a byte-level BPE of `bpe_vocab`
    tokens trained here), warm it up on `task` (default: addition) until `warmup_accuracy` when that is > 0
    (None: 0.25 for the char tokenizer, no warm start for BPE), save it to `out`; returns what was built (also in
    swarmrl.json)."""
    console = console or Console()
    torch.set_num_threads(1)
    tok = make_tokenizer(tokenizer, bpe_vocab, seed=cfg.seed)
    model = build_model(cfg, tok)
    n_params = count_parameters(model)
    meta: dict[str, Any] = {"arch": cfg.arch, "parameters": n_params, "tokenizer": tokenizer, "vocab": len(tok),
                            "model": cfg.model_dump()}
    console.print(f"[bold]model[/] {type(model).__name__}, {n_params / 1e6:.2f}M parameters, {tokenizer} tokenizer "
                  f"of {len(tok)} tokens")
    target = warmup_accuracy if warmup_accuracy is not None else (CHAR_WARMUP_ACCURACY if tokenizer == "char" else 0)
    if target <= 0:
        return warm_and_save(model, tok, out, meta, None, WarmupConfig(target_accuracy=0), console)
    spec = task or TaskSpec()
    loaded = load_task(spec)
    try:
        return warm_and_save(model, tok, out, {**meta, "task": spec.model_dump()}, loaded,
                             WarmupConfig(target_accuracy=target), console, seed=cfg.seed)
    finally:
        loaded.close()


def build_and_warm(out: Path, target_accuracy: float = CHAR_WARMUP_ACCURACY, seed: int = 0,
                   task: TaskSpec | None = None, console: Console | None = None) -> float:
    """The demo's model: the tiny Llama with the character tokenizer, warm-started on `task` (default: addition);
    returns its greedy accuracy on the held-out set."""
    meta = build_checkpoint(out, ModelConfig(seed=seed), "char", warmup_accuracy=target_accuracy, task=task,
                            console=console)
    return float(meta.get("warmup_accuracy", 0.0))
