"""`addition`: sums of two `digits`-digit numbers, `123+456=` -> `579` (the demo's task)."""

from __future__ import annotations

import random
from functools import cached_property
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from swarmrl.protocol.tasks import Problem, Task


class AdditionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    digits: int = Field(3, ge=1, le=18, description="Digits of each addend.")
    eval_size: int = Field(500, ge=1, description="Problems in the held-out set.")
    eval_seed: int = Field(20261129, description="Seed that fixes the held-out set.")
    max_new_tokens: int = Field(8, ge=1, description="Greedy completion length for held-out evaluation.")


class AdditionTask(Task):
    """`123+456=` -> `579`. The held-out set is fixed by `eval_seed`; training prompts never include one of
    its problems, so evaluation measures generalisation, not memory."""

    name = "addition"
    Options = AdditionOptions
    options: AdditionOptions

    def __init__(self, options: AdditionOptions | None = None, data_dir: Path | None = None):
        super().__init__(options or AdditionOptions(), data_dir or Path.cwd())
        n = 9 * 10 ** (self.options.digits - 1)
        if self.options.eval_size > n * n // 2:
            raise ValueError(f"eval_size {self.options.eval_size} leaves too few {self.options.digits}-digit "
                             "problems to train on")

    def _draw(self, rng: random.Random) -> Problem:
        lo, hi = 10 ** (self.options.digits - 1), 10**self.options.digits - 1
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b), solution=str(a + b))

    @cached_property
    def _eval(self) -> tuple[Problem, ...]:
        rng = random.Random(self.options.eval_seed)
        seen: dict[str, Problem] = {}
        while len(seen) < self.options.eval_size:
            p = self._draw(rng)
            seen.setdefault(p.prompt, p)
        return tuple(seen.values())

    @cached_property
    def _eval_prompts(self) -> frozenset[str]:
        return frozenset(p.prompt for p in self._eval)

    def eval_set(self) -> tuple[Problem, ...]:
        return self._eval

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

    def is_correct(self, completion: str, answer: str) -> bool:
        return completion.strip() == answer
