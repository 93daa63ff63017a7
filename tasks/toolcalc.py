"""A tool-using task over several turns: the model multiplies by calling a calculator (`calculator`), then answers.

`tool_arithmetic` asks `What is 37 * 48?`. A model too small to multiply can still earn full reward: its first turn
calls the tool (`calc 37 * 48`), the environment answers `1776` as the next user message, and its second turn
copies the result. The run sets `sampling.max_turns` (2 or more) and `[run.environment] name = "calculator"`.

The calculator is the worked example of `protocol.episodes`: a pure function of the model's turn, so the verifier
replays every environment turn. It evaluates integer arithmetic (+, -, *, parentheses) with the standard library's
parser, bounded in length, depth and size, so a hostile turn costs microseconds; a turn that is not a tool call
ends the episode, and is the answer the task scores.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from swarmrl.protocol.episodes import Environment
from swarmrl.protocol.tasks import EvalSettings, Problem
from swarmrl.tasks.heldout import DrawnTask, digits_reward

_CALL = re.compile(r"\s*calc\s+(.{1,64}?)\s*")
_OPS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__}
MAX_DEPTH = 8
MAX_VALUE = 10**18


def evaluate(expr: str) -> str:
    """`expr` (integers, + - *, parentheses) evaluated, as text; an error message for anything else. Bounded: at
    most 64 characters, nesting MAX_DEPTH, values within MAX_VALUE."""
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError):
        return "error: not an arithmetic expression"

    def value(node: ast.AST, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise ValueError("nested too deep")
        if isinstance(node, ast.Constant) and type(node.value) is int:
            out = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            out = -value(node.operand, depth + 1)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            out = _OPS[type(node.op)](value(node.left, depth + 1), value(node.right, depth + 1))
        else:
            raise ValueError("only integers, + - * and parentheses")
        if abs(out) > MAX_VALUE:
            raise ValueError("too large")
        return out

    try:
        return str(value(tree.body, 0))
    except ValueError as e:
        return f"error: {e}"


class Calculator(Environment):
    """Answers `calc <expression>` with the expression's value; any other turn ends the episode."""

    name = "calculator"
    probes = (("What is 12 * 34?", ("calc 12 * 34", "408")), ("What is 2 * 3?", ("calc 2 ** 99", "calc (((1)))")),
              ("What is 9 * 9?", ("calc 99999999999 * 99999999999", "81")))

    def respond(self, prompt: str, turns: Sequence[str], seed: int) -> str | None:
        call = _CALL.fullmatch(turns[-1])
        return None if call is None else evaluate(call.group(1))


class ToolArithmeticOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    digits: int = Field(2, ge=1, le=6, description="Digits of each factor.")
    eval_size: int = Field(300, ge=1, description="Problems in the held-out set.")
    eval_seed: int = Field(20261206, description="Seed that fixes the held-out set.")
    max_new_tokens: int = Field(16, ge=1, description="Tokens of each model turn in held-out evaluation.")
    max_turns: int = Field(2, ge=1, le=16, description="Model turns of a held-out episode (the run's max_turns).")


class ToolArithmeticTask(DrawnTask):
    """`What is 37 * 48?` -> `1776`, scored on the episode's last model turn; the reference episode calls the
    calculator, then copies its answer."""

    name = "tool_arithmetic"
    Options = ToolArithmeticOptions
    options: ToolArithmeticOptions

    def __init__(self, options: ToolArithmeticOptions | None = None, data_dir: Path | None = None):
        super().__init__(options or ToolArithmeticOptions(), data_dir or Path.cwd())
        self._require_room((9 * 10 ** (self.options.digits - 1)) ** 2)

    def _draw(self, rng: random.Random) -> Problem:
        lo, hi = 10 ** (self.options.digits - 1), 10**self.options.digits - 1
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        return Problem(prompt=f"What is {a} * {b}?", answer=str(a * b), solution=str(a * b),
                       solution_turns=(f"calc {a} * {b}", str(a * b)))

    def reward(self, completion: str, answer: str) -> float:
        """1 for the exact product; else a quarter point scaled by the digits in the right place."""
        return digits_reward(completion, answer, 0.25)

    def is_correct(self, completion: str, answer: str) -> bool:
        return completion.strip() == answer

    @property
    def eval_settings(self) -> EvalSettings:
        return EvalSettings(max_new_tokens=self.options.max_new_tokens, max_turns=self.options.max_turns)
