"""Greedy accuracy on the task's fixed held-out set (`Task.is_correct`, with the task's evaluation settings); for
a multi-turn run, of greedy episodes against its environment, scored on their last model turn.

Prompts are tokenized with `models.prompts.render_prompt` (the chat template when the tokenizer has one), as
nodes and the verifier do, and a completion ends at any of the model's stop tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.models.episodes import Episode
from swarmrl.models.prompts import pad_token_id, render_prompt, stop_token_ids
from swarmrl.protocol.episodes import Environment, load_environment
from swarmrl.protocol.run import RunSpec, SamplingSpec
from swarmrl.protocol.tasks import Problem, Task

Episodes = tuple[Environment, SamplingSpec]
"""A multi-turn run's environment and sampling limits: evaluation plays episodes against them."""


def run_episodes(spec: RunSpec) -> Episodes | None:
    """The run's environment (loaded, its replay checked) and sampling, for a multi-turn run; None otherwise."""
    return None if spec.environment is None else (load_environment(spec.environment), spec.sampling)


@torch.no_grad()
def greedy_complete(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_new_tokens: int,
    synced_gpus: bool = False,
) -> list[str]:
    """Greedy completions (stopped at any stop token) for a batch of prompts, decoded to text.

    `synced_gpus=True` under FSDP: every rank keeps stepping until all ranks are done, since each forward
    is a collective.
    """
    stops = stop_token_ids(model=model, tokenizer=tokenizer)
    rendered = [render_prompt(tokenizer, p) for p in prompts]
    return [tokenizer.decode(t[:-1] if t and t[-1] in stops else t, skip_special_tokens=True)
            for t in greedy_ids(model, tokenizer, rendered, max_new_tokens, synced_gpus)]


@torch.no_grad()
def greedy_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rendered: list[list[int]],
               max_new_tokens: int, synced_gpus: bool = False) -> list[list[int]]:
    """Greedy completions of token-id prompts, each up to and including its first stop token (or max_new_tokens
    long)."""
    was_training = model.training
    model.eval()
    stops = sorted(stop_token_ids(model=model, tokenizer=tokenizer))
    pad = pad_token_id(tokenizer)
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
    done = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        done.append(row[:end])
    return done


def greedy_episodes(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], env: Environment,
                    sampling: SamplingSpec, synced_gpus: bool = False) -> list[str]:
    """The last model turn (decoded) of greedy multi-turn episodes against `env`, under the run's limits
    (`sampling`): played by the rules nodes and the verifier follow (`models.episodes`), with seed 0."""
    stops = stop_token_ids(model=model, tokenizer=tokenizer)
    limit = getattr(model.config, "max_position_embeddings", None)
    rendered = [render_prompt(tokenizer, p) for p in prompts]
    episodes = [Episode(env, tokenizer, sampling, stops, p, len(r), limit) for p, r in zip(prompts, rendered,
                                                                                           strict=True)]
    written: list[list[int]] = [[] for _ in prompts]
    model_turns: list[list[list[int]]] = [[] for _ in prompts]
    going = list(range(len(prompts)))
    while going:
        budgets = [episodes[i].turn_budget(len(written[i])) for i in going]
        outs = greedy_ids(model, tokenizer, [rendered[i] + written[i] for i in going], max(budgets), synced_gpus)
        still = []
        for i, budget, ids in zip(going, budgets, outs, strict=True):
            ids = ids[:budget]
            written[i] += ids
            model_turns[i].append(ids)
            nxt = episodes[i].after_model_turn(model_turns[i], len(written[i]), 0)
            if nxt.reply_ids is not None:
                written[i] += nxt.reply_ids
                still.append(i)
        going = still
    return [tokenizer.decode(t[-1][:-1] if t[-1] and t[-1][-1] in stops else t[-1], skip_special_tokens=True)
            for t in model_turns]


def _completions(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 problems: tuple[Problem, ...] | list[Problem], task: Task, max_new_tokens: int | None,
                 batch_size: int, synced_gpus: bool = False, episodes: Episodes | None = None,
                 ) -> Iterator[tuple[str, Problem]]:
    """(greedy completion, problem) for each of `problems`, generated `batch_size` at a time (`max_new_tokens`:
    default the task's); with `episodes`, the last model turn of a greedy episode (`greedy_episodes`)."""
    max_new_tokens = max_new_tokens or task.eval_settings.max_new_tokens
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        prompts = [p.prompt for p in chunk]
        texts = (greedy_complete(model, tokenizer, prompts, max_new_tokens, synced_gpus) if episodes is None else
                 greedy_episodes(model, tokenizer, prompts, *episodes, synced_gpus=synced_gpus))
        yield from zip(texts, chunk, strict=True)


def correct_count(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: tuple[Problem, ...] | list[Problem],
    task: Task,
    synced_gpus: bool = False,
    episodes: Episodes | None = None,
    max_new_tokens: int | None = None,
    batch_size: int = 500,
) -> int:
    """How many of `problems` the greedy completion (with `episodes`: episode) gets right. `max_new_tokens`: default
    the task's."""
    return sum(task.is_correct(text, p.answer) for text, p in _completions(
        model, tokenizer, problems, task, max_new_tokens, batch_size, synced_gpus, episodes))


def accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: tuple[Problem, ...] | list[Problem],
    task: Task,
    max_new_tokens: int | None = None,
    batch_size: int = 500,
    episodes: Episodes | None = None,
) -> float:
    """Fraction of `problems` whose greedy completion (with `episodes`: episode) is right. `max_new_tokens`: default
    the task's."""
    return correct_count(model, tokenizer, problems, task, episodes=episodes, max_new_tokens=max_new_tokens,
                         batch_size=batch_size) / max(len(problems), 1)


def held_out_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: tuple[Problem, ...] | list[Problem],
    task: Task,
    max_new_tokens: int | None = None,
    batch_size: int = 500,
    episodes: Episodes | None = None,
) -> tuple[float, float]:
    """(accuracy, mean reward) of the greedy completions (with `episodes`: episodes) of `problems`: the share
    `Task.is_correct` accepts, and the mean of `Task.reward` (the trusted reward, partial credit included)."""
    correct, reward = 0, 0.0
    for text, p in _completions(model, tokenizer, problems, task, max_new_tokens, batch_size, episodes=episodes):
        correct += task.is_correct(text, p.answer)
        reward += task.reward(text, p.answer)
    n = max(len(problems), 1)
    return correct / n, reward / n
