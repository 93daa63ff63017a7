"""The held-out machinery every task shares: a fixed held-out set, and training prompts that never include one of it.

Two kinds of task draw their problems differently:
- `DrawnTask`: a seeded generator (`addition`, `tool_arithmetic`). The held-out set is the first `eval_size`
  distinct problems drawn from `eval_seed`; training problems are drawn from the lease's generator.
- `IndexedTask`: a finite, ordered collection (`reasoning_gym`, `verifiers`). Its first `eval_size` items are
  held out; training problems are drawn from the rest by index.
Either way a training prompt equal to a held-out one is drawn again, so held-out accuracy measures
generalisation, not memory.
"""

from __future__ import annotations

import random
from abc import abstractmethod
from functools import cached_property

from swarmrl.protocol.tasks import Problem, Task

MAX_DRAWS = 10_000
"""Training draws in a row that may hit held-out prompts before an indexed task says its collection is too small."""


class _HeldOut(Task):
    """What both kinds share: the held-out set, cached once per task (`_held_out` builds it)."""

    @abstractmethod
    def _held_out(self) -> tuple[Problem, ...]:
        """The held-out problems, distinct by prompt, in a fixed order."""

    @cached_property
    def _eval(self) -> tuple[Problem, ...]:
        return self._held_out()

    @cached_property
    def _eval_prompts(self) -> frozenset[str]:
        return frozenset(p.prompt for p in self._eval)

    def eval_set(self) -> tuple[Problem, ...]:
        return self._eval


class DrawnTask(_HeldOut):
    """A task drawn by `_draw(rng)`; its options carry `eval_size` and `eval_seed`."""

    def _require_room(self, problems: int) -> None:
        """Refuse a held-out set that would take more than half of the `problems` the options allow."""
        if self.options.eval_size > problems // 2:
            raise ValueError(f"eval_size {self.options.eval_size} leaves too few problems to train on (of "
                             f"{problems} the task's options allow)")

    @abstractmethod
    def _draw(self, rng: random.Random) -> Problem:
        """One problem, a function of `rng`'s state alone."""

    def _held_out(self) -> tuple[Problem, ...]:
        rng = random.Random(self.options.eval_seed)
        seen: dict[str, Problem] = {}
        while len(seen) < self.options.eval_size:
            p = self._draw(rng)
            seen.setdefault(p.prompt, p)
        return tuple(seen.values())

    def sample(self, rng: random.Random) -> Problem:
        while True:
            p = self._draw(rng)
            if p.prompt not in self._eval_prompts:
                return p


class IndexedTask(_HeldOut):
    """A task over items `_problem(0)` .. `_problem(_items() - 1)`; its options carry `eval_size`."""

    @abstractmethod
    def _problem(self, index: int) -> Problem:
        """Item `index` as a problem (the same on every call and machine)."""

    @abstractmethod
    def _items(self) -> int:
        """How many items there are (more than `eval_size`: the options refuse less)."""

    def _held_out(self) -> tuple[Problem, ...]:
        seen: dict[str, Problem] = {}
        for i in range(self.options.eval_size):
            p = self._problem(i)
            seen.setdefault(p.prompt, p)
        return tuple(seen.values())

    def sample(self, rng: random.Random) -> Problem:
        for _ in range(MAX_DRAWS):
            p = self._problem(rng.randrange(self.options.eval_size, self._items()))
            if p.prompt not in self._eval_prompts:
                return p
        raise RuntimeError(f"{self.name}: {MAX_DRAWS} training draws in a row were held-out prompts: there are too "
                           f"few distinct problems for eval_size {self.options.eval_size}")


def digits_reward(completion: str, answer: str, partial: float) -> float:
    """1 for the exact answer; else `partial` scaled by the share of characters in the right place."""
    text = completion.strip()
    if text == answer:
        return 1.0
    right = sum(1 for a, b in zip(text, answer, strict=False) if a == b)
    return partial * right / max(len(answer), len(text), 1)
