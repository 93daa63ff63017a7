"""Greedy accuracy on the task's fixed held-out set (`Task.is_correct`, with the task's evaluation settings)."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from swarmrl.protocol.tasks import Problem, Task


@torch.no_grad()
def greedy_complete(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: list[str], max_new_tokens: int,
    synced_gpus: bool = False,
) -> list[str]:
    """Greedy completions (stopped at EOS) for a batch of prompts, decoded to text.

    `synced_gpus=True` under FSDP: every rank keeps stepping until all ranks are done, since each forward
    is a collective.
    """
    was_training = model.training
    model.eval()
    enc = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        synced_gpus=synced_gpus,
    )
    model.train(was_training)
    texts = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id)]
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts


def correct_count(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: tuple[Problem, ...] | list[Problem],
    task: Task,
    max_new_tokens: int | None = None,
    batch_size: int = 500,
    synced_gpus: bool = False,
) -> int:
    """How many of `problems` the greedy completion gets right. `max_new_tokens`: default the task's."""
    max_new_tokens = max_new_tokens or task.eval_settings.max_new_tokens
    correct = 0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        texts = greedy_complete(model, tokenizer, [p.prompt for p in chunk], max_new_tokens, synced_gpus)
        correct += sum(task.is_correct(t, p.answer) for t, p in zip(texts, chunk, strict=True))
    return correct


def accuracy(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: tuple[Problem, ...] | list[Problem],
    task: Task,
    max_new_tokens: int | None = None,
    batch_size: int = 500,
) -> float:
    """Fraction of `problems` whose greedy completion is right. `max_new_tokens`: default the task's."""
    return correct_count(model, tokenizer, problems, task, max_new_tokens, batch_size) / max(len(problems), 1)
