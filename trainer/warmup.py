"""Supervised warm start: teach the format until greedy accuracy reaches a target, then stop.

RL needs a policy that sometimes gets the answer right. Accuracy jumps late and abruptly during this
phase, so we stop on a measured accuracy, checked every `eval_every` steps, not on a step count.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.models.prompts import pad_token_id, render_prompt
from swarmrl.protocol.tasks import Task
from swarmrl.trainer.evaluate import accuracy


@dataclass
class WarmupConfig:
    target_accuracy: float = 0.25
    """Stop as soon as greedy accuracy on the held-out set reaches this."""
    max_steps: int = 3000
    """Give up (and keep what was learned) after this many steps."""
    batch_size: int = 64
    lr: float = 1e-3
    eval_every: int = 25
    seed: int = 0


def _batch(task: Task, tokenizer: PreTrainedTokenizerBase, rng: random.Random, n: int):
    problems = [task.sample(rng) for _ in range(n)]
    prompts = [render_prompt(tokenizer, p.prompt) for p in problems]
    answers = [tokenizer(p.answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
               for p in problems]
    length = max(len(p) + len(a) for p, a in zip(prompts, answers, strict=True))
    ids = torch.full((n, length), pad_token_id(tokenizer))
    labels = torch.full((n, length), -100)
    mask = torch.zeros((n, length), dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        seq = p + a
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(a)
        mask[i, : len(seq)] = 1
    return ids, labels, mask


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    cfg: WarmupConfig,
    on_eval: Callable[[int, float, float], None] | None = None,
) -> float:
    """Train `model` in place on answers until the target accuracy; returns the final accuracy."""
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    model.train()
    acc = 0.0
    for step in range(1, cfg.max_steps + 1):
        ids, labels, mask = _batch(task, tokenizer, rng, cfg.batch_size)
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # Accuracy rises abruptly near the end: check five times as often once it is on its way, so that
        # the warm start stops close to the target rather than far past it.
        every = cfg.eval_every if acc < cfg.target_accuracy / 4 else max(1, cfg.eval_every // 5)
        if step % every == 0:
            acc = accuracy(model, tokenizer, task.eval_set(), task)
            if on_eval is not None:
                on_eval(step, loss.item(), acc)
            if acc >= cfg.target_accuracy:
                break
    model.eval()
    return acc
