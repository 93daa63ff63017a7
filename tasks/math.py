"""`math`: questions with a final answer, read from a pinned JSONL file, scored by answer equivalence.

Each line is `{"question": ..., "answer": ...}` (`"problem"` is accepted for `"question"`). An answer in
GSM8K's form, worked solution then `#### 42`, counts as the text after the last `####`. Answers may be
numbers or LaTeX (`\\frac{1}{2}`, `\\sqrt{2}`, `x^2+1`). An optional `"solution"` is the completion a
supervised warm start teaches (default: the final answer); rewards never read it.

Reward: 1 when the completion's final answer equals the reference mathematically, else 0. math-verify
(sympy underneath) extracts the final answer, the last `\\boxed{...}` first, else the last expression or
number in the text, and compares values, so `1/2`, `0.5`, `\\frac{1}{2}`, `\\boxed{\\frac12}` and
"The answer is 0.5" all match `1/2`. Comparison runs in a worker process with time and memory bounds
(`swarmrl.tasks.mathcheck`): a completion that makes sympy hang scores 0, and one nested absurdly
deep scores 0 unparsed (that module says what scoring may cost).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from swarmrl.protocol.tasks import Problem, Scored, Task
from swarmrl.tasks.data import FileTaskOptions, load_split
from swarmrl.tasks.mathcheck import MathChecker
from swarmrl.tasks.templates import question_template


class MathOptions(FileTaskOptions):
    template: str = Field("{question}", description="Prompt text; `{question}` is replaced by the question.")
    verify_timeout_s: int = Field(2, ge=1, le=60, description="math-verify's time limit per parse and per "
                                  "comparison, seconds (a completion that exceeds it scores 0).")
    memory_mb: int = Field(2048, ge=256, description="Address-space limit of the answer-checking worker, MiB.")

    @field_validator("template")
    @classmethod
    def _has_question(cls, template: str) -> str:
        return question_template(template)


def gsm8k_answer(text: str) -> str:
    """The final answer of a GSM8K-style solution (`... #### 42` -> `42`); other text unchanged but stripped."""
    return text.rsplit("####", 1)[-1].strip()


class MathTask(Task):
    """Questions from `path`; held-out problems from `eval_path` or a seeded `eval_fraction` of `path`."""

    name = "math"
    Options = MathOptions
    options: MathOptions

    def __init__(self, options: MathOptions, data_dir: Path):
        super().__init__(options, data_dir)
        self._train, self._eval = load_split(options, data_dir, self._parse)
        self._checker = MathChecker(options.verify_timeout_s, options.memory_mb)
        if not self._checker.equivalent("\\frac{1}{2}", "0.5"):  # fail at load, not at the first reward
            raise RuntimeError("math-verify does not work here: the answer checker found 1/2 != 0.5")

    def _parse(self, record: dict[str, Any]) -> Problem:
        question = record["question"] if "question" in record else record["problem"]
        answer = gsm8k_answer(str(record["answer"]))
        if not isinstance(question, str) or not question.strip() or not answer:
            raise ValueError("empty question or answer")
        solution = record.get("solution", answer)
        if not isinstance(solution, str) or not solution.strip():
            raise ValueError("solution must be non-empty text")
        return Problem(prompt=self.options.template.format(question=question), answer=answer, solution=solution)

    def sample(self, rng: random.Random) -> Problem:
        return self._train[rng.randrange(len(self._train))]

    def eval_set(self) -> list[Problem]:
        return list(self._eval)

    def reward(self, completion: str, answer: str) -> float:
        return self.scored(completion, answer).reward

    def scored(self, completion: str, answer: str) -> Scored:
        ok, limited = self._checker.check(completion, answer)
        return Scored(1.0 if ok else 0.0, limited=limited)

    def close(self) -> None:
        self._checker.close()
