"""`addition`: sums of two `digits`-digit numbers, `123+456=` -> `579` (the demo's task)."""

from __future__ import annotations

import random
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from swarmrl.protocol.tasks import Problem
from swarmrl.tasks.heldout import DrawnTask, digits_reward


class AdditionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    digits: int = Field(3, ge=1, le=18, description="Digits of each addend.")
    eval_size: int = Field(500, ge=1, description="Problems in the held-out set.")
    eval_seed: int = Field(20261129, description="Seed that fixes the held-out set.")
    max_new_tokens: int = Field(8, ge=1, description="Greedy completion length for held-out evaluation.")


class AdditionTask(DrawnTask):
    """`123+456=` -> `579`. The held-out set is fixed by `eval_seed`; training prompts never include one of
    its problems, so evaluation measures generalisation, not memory."""

    name = "addition"
    Options = AdditionOptions
    options: AdditionOptions

    def __init__(self, options: AdditionOptions | None = None, data_dir: Path | None = None):
        super().__init__(options or AdditionOptions(), data_dir or Path.cwd())
        self._require_room((9 * 10 ** (self.options.digits - 1)) ** 2)

    def _draw(self, rng: random.Random) -> Problem:
        lo, hi = 10 ** (self.options.digits - 1), 10**self.options.digits - 1
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b), solution=str(a + b))

    def reward(self, completion: str, answer: str) -> float:
        """1 for the exact answer; else half a point scaled by the digits in the right place."""
        return digits_reward(completion, answer, 0.5)

    def is_correct(self, completion: str, answer: str) -> bool:
        return completion.strip() == answer
