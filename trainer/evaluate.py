"""Greedy accuracy on the task's fixed held-out set (`Task.is_correct`, with the task's evaluation settings).

Prompts are tokenized with `models.prompts.render_prompt` (the chat template when the tokenizer has one), as
nodes and the verifier do, and a completion ends at any of the model's stop tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.models.prompts import pad_token_id, render_prompt, stop_token_ids
from swarmrl.protocol.tasks import Problem, Task


@torch.no_grad()
def greedy_complete(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_new_tokens: int,
    synced_gpus: bool = False,
) -> list[str]:
    """Greedy completions (stopped at any stop token) for a batch of prompts, decoded to text.

    `synced_gpus=True` under FSDP: every rank keeps stepping until all ranks are done, since each forward
    is a collective.
    """
    was_training = model.training
    model.eval()
    stops = sorted(stop_token_ids(model=model, tokenizer=tokenizer))
    pad = pad_token_id(tokenizer)
    rendered = [render_prompt(tokenizer, p) for p in prompts]
    width = max(len(r) for r in rendered)
    ids = torch.full((len(rendered), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rendered), width), dtype=torch.long)
    for i, r in enumerate(rendered):  # left padding: every row's next token comes right after its prompt
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=pad,
        synced_gpus=synced_gpus,
    )
    model.train(was_training)
    texts = []
    for row in out[:, width:].tolist():
        end = next((i for i, t in enumerate(row) if t in stops), len(row))
        texts.append(tokenizer.decode(row[:end], skip_special_tokens=True))
    return texts


def _completions(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 problems: tuple[Problem, ...] | list[Problem], task: Task, max_new_tokens: int | None,
                 batch_size: int, synced_gpus: bool = False) -> Iterator[tuple[str, Problem]]:
    """(greedy completion, problem) for each of `problems`, generated `batch_size` at a time (`max_new_tokens`:
    default the task's)."""
    max_new_tokens = max_new_tokens or task.eval_settings.max_new_tokens
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        texts = greedy_complete(model, tokenizer, [p.prompt for p in chunk], max_new_tokens, synced_gpus)
        yield from zip(texts, chunk, strict=True)


def correct_count(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: tuple[Problem, ...] | list[Problem],
    task: Task,
    max_new_tokens: int | None = None,
    batch_size: int = 500,
    synced_gpus: bool = False,
) -> int:
    """How many of `problems` the greedy completion gets right. `max_new_tokens`: default the task's."""
    return sum(task.is_correct(text, p.answer)
               for text, p in _completions(model, tokenizer, problems, task, max_new_tokens, batch_size, synced_gpus))


def accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: tuple[Problem, ...] | list[Problem],
    task: Task,
    max_new_tokens: int | None = None,
    batch_size: int = 500,
) -> float:
    """Fraction of `problems` whose greedy completion is right. `max_new_tokens`: default the task's."""
    return correct_count(model, tokenizer, problems, task, max_new_tokens, batch_size) / max(len(problems), 1)


def held_out_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: tuple[Problem, ...] | list[Problem],
    task: Task,
    max_new_tokens: int | None = None,
    batch_size: int = 500,
) -> tuple[float, float]:
    """(accuracy, mean reward) of the greedy completions of `problems`: the share `Task.is_correct` accepts, and
    the mean of `Task.reward` (the trusted reward, partial credit included)."""
    correct, reward = 0, 0.0
    for text, p in _completions(model, tokenizer, problems, task, max_new_tokens, batch_size):
        correct += task.is_correct(text, p.answer)
        reward += task.reward(text, p.answer)
    n = max(len(problems), 1)
    return correct / n, reward / n
