"""Tasks: how prompts are made, and how a completion is scored.

All roles agree on these: the coordinator draws prompts (and keeps the answers), the verifier scores
completions on the trusted side, the trainer evaluates on the held-out set. A node never sees answers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class TaskSpec(BaseModel):
    """Which task a run trains on, and its options: part of the run description every role reads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("addition3", description="A registered task name.")
    options: dict[str, Any] = Field(default_factory=dict, description="The task's own options.")


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class Task:
    """A family of prompts with checkable answers."""

    name: str = ""

    def sample(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def reward(self, completion: str, answer: str) -> float:
        raise NotImplementedError

    def is_correct(self, completion: str, answer: str) -> bool:
        return completion.strip() == answer


@dataclass(frozen=True)
class Addition(Task):
    """`123+456=` -> `579`: sums of two `digits`-digit numbers.

    The held-out evaluation set is fixed by `eval_seed`; training prompts never include one of its
    problems, so evaluation measures generalisation, not memory.
    """

    digits: int = 3
    eval_size: int = 500
    eval_seed: int = 20261129
    name: str = "addition3"

    def _draw(self, rng: random.Random) -> Problem:
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b))

    @cached_property
    def eval_set(self) -> tuple[Problem, ...]:
        rng = random.Random(self.eval_seed)
        seen: dict[str, Problem] = {}
        while len(seen) < self.eval_size:
            p = self._draw(rng)
            seen.setdefault(p.prompt, p)
        return tuple(seen.values())

    @cached_property
    def _eval_prompts(self) -> frozenset[str]:
        return frozenset(p.prompt for p in self.eval_set)

    def sample(self, rng: random.Random) -> Problem:
        while True:
            p = self._draw(rng)
            if p.prompt not in self._eval_prompts:
                return p

    def reward(self, completion: str, answer: str) -> float:
        """1 for the exact answer; else half a point scaled by the digits in the right place."""
        text = completion.strip()
        if text == answer:
            return 1.0
        right = sum(1 for a, b in zip(text, answer, strict=False) if a == b)
        return 0.5 * right / max(len(answer), len(text), 1)


TASKS: dict[str, Task] = {"addition3": Addition()}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}") from None


def load_task(spec: TaskSpec) -> Task:
    """The task `spec` names, with its options applied."""
    if spec.options:
        raise ValueError(f"task {spec.name!r} takes no options")
    return get_task(spec.name)
