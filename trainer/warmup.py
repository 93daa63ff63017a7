"""Supervised warm start: teach the task's format until greedy accuracy reaches a target, then stop.

RL needs a policy that sometimes gets the answer right. Any task whose training problems carry a reference
completion (`Problem.solution`: the answer for addition and math, a reference program for code) and any causal
LM work: prompts are rendered with `render_prompt` (the chat template when the tokenizer has one), as the nodes,
the verifier and the trainer render them, and the loss is on the solution's tokens and one stop token.
Accuracy jumps late and abruptly during this phase, so we stop on a measured accuracy, checked every
`eval_every` steps, not on a step count.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.models.episodes import Episode
from swarmrl.models.prompts import pad_token_id, render_prompt, stop_token_ids
from swarmrl.protocol.tasks import Problem, Task
from swarmrl.trainer.evaluate import Episodes, accuracy


class WarmupConfig(BaseModel):
    """How a supervised warm start runs and when it stops."""

    model_config = ConfigDict(extra="forbid")

    target_accuracy: float = Field(0.25, ge=0, le=1, description="Stop as soon as greedy accuracy on the held-out "
                                   "problems reaches this; 0: no warm start.")
    max_steps: int = Field(3000, ge=1, description="Give up (and keep what was learned) after this many steps.")
    batch_size: int = Field(64, ge=1, description="Training problems per step.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    eval_every: int = Field(25, ge=1, description="Measure held-out accuracy every this many steps (five times as "
                            "often once it passes a quarter of the target).")
    eval_size: int | None = Field(None, ge=1, description="Held-out problems per measurement (the first ones of "
                                  "the task's held-out set); None: all of them.")


def _batch(task: Task, tokenizer: PreTrainedTokenizerBase, rng: random.Random, n: int, stop: int,
           episodes: Episodes | None = None):
    problems = [task.sample(rng) for _ in range(n)]
    prompts = [render_prompt(tokenizer, p.prompt) for p in problems]
    targets = [(tokenizer(_solution(p, task), add_special_tokens=False).input_ids + [stop], None) if episodes is None
               else _episode(p, task, tokenizer, stop, len(r), episodes)
               for p, r in zip(problems, prompts, strict=True)]
    length = max(len(p) + len(a) for p, (a, _) in zip(prompts, targets, strict=True))
    ids = torch.full((n, length), pad_token_id(tokenizer))
    labels = torch.full((n, length), -100)
    mask = torch.zeros((n, length), dtype=torch.long)
    for i, (p, (a, learned)) in enumerate(zip(prompts, targets, strict=True)):
        seq = p + a
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(a if learned is None else
                                                    [t if keep else -100 for t, keep in zip(a, learned, strict=True)])
        mask[i, : len(seq)] = 1
    return ids, labels, mask


def _episode(problem: Problem, task: Task, tokenizer: PreTrainedTokenizerBase, stop: int, prompt_len: int,
             episodes: Episodes) -> tuple[list[int], list[bool]]:
    """The reference episode's tokens (`Problem.solution_turns`, the environment answering between them by the
    rules of `models.episodes`) and which of them the model writes (the loss is on those only)."""
    if problem.solution_turns is None:
        raise ValueError(f"task {task.name!r}: a multi-turn run's warm start needs reference episodes "
                         "(Problem.solution_turns)")
    env, sampling = episodes
    ep = Episode(env, tokenizer, sampling, {stop}, problem.prompt, prompt_len)
    tokens: list[int] = []
    learned: list[bool] = []
    turns: list[list[int]] = []
    for k, text in enumerate(problem.solution_turns):
        turn = tokenizer(text, add_special_tokens=False).input_ids + [stop]
        tokens += turn
        learned += [True] * len(turn)
        turns.append(turn)
        nxt = ep.after_model_turn(turns, len(tokens), 0)
        if nxt.reply_ids is None:
            if k + 1 < len(problem.solution_turns):
                raise ValueError(f"task {task.name!r}: the environment ends a reference episode after {k + 1} of its "
                                 f"{len(problem.solution_turns)} turns")
            break
        tokens += nxt.reply_ids
        learned += [False] * len(nxt.reply_ids)
    return tokens, learned


def _solution(problem: Problem, task: Task) -> str:
    if problem.solution is None:
        raise ValueError(f"task {task.name!r}: a training problem has no reference solution to warm up on (for "
                         "file-backed tasks, give each problem a 'solution' field)")
    return problem.solution


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    cfg: WarmupConfig,
    on_eval: Callable[[int, float, float], None] | None = None,
    seed: int = 0,
    episodes: Episodes | None = None,
) -> float:
    """Train `model` in place on the task's reference solutions (training problems drawn with `seed`; with
    `episodes`, a multi-turn run's, the reference episodes) until the target accuracy; returns the last accuracy
    measured (on `cfg.eval_size` held-out problems)."""
    rng = random.Random(seed)
    held_out = list(task.eval_set())[: cfg.eval_size]
    # The completion ends with the tokenizer's eos when it is a stop token (ChatML's <|im_end|>), else the
    # model's first stop token: what the engines end a completion at.
    stops = stop_token_ids(model=model, tokenizer=tokenizer)
    stop = tokenizer.eos_token_id if tokenizer.eos_token_id in stops else min(stops)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    model.train()
    acc = 0.0
    for step in range(1, cfg.max_steps + 1):
        ids, labels, mask = _batch(task, tokenizer, rng, cfg.batch_size, stop, episodes)
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
            acc = accuracy(model, tokenizer, held_out, task, episodes=episodes)
            if on_eval is not None:
                on_eval(step, loss.item(), acc)
            if acc >= cfg.target_accuracy:
                break
    model.eval()
    return acc
