"""`code`: programming problems with stdin/stdout test cases, read from a pinned JSONL file.

Each line is `{"prompt": "...", "tests": [{"input": "1 2\\n", "output": "3\\n"}, ...]}`: the completion is a
Python program that reads a case's `input` on stdin and must print its `output` (compared line by line,
trailing whitespace ignored). The tests are the problem's answer: they stay on the trusted side. An optional
`"solution"` (a reference completion, e.g. a fenced program) is what a supervised warm start teaches; rewards
never read it.

Why input/output cases and not asserts run next to the program: a program shares its interpreter with
whatever runs in it, so it could forge an assert harness's verdict (exit 0 early, patch `AssertionError`,
read the expected values from the harness). Here the expected output never enters the sandbox, and the
verdict is taken outside it.

The program is the last fenced block of the completion (```python ... ```), or the whole completion if it
has none. Every case runs in its own sandbox (`swarmrl.tasks.sandbox`). Reward: the share of cases whose
run exits 0 with the expected output; 0 as soon as a run hits a limit (time, output, CPU, file size), so a
completion that loops, forks without end or floods output scores 0 and costs at most one wall-clock limit.

A rollout's cases share one wall-clock cap, `rollout_sandbox_s`: each case may run for what the earlier ones
left of it (and at most `sandbox.wall_s`), and a rollout that spends it scores 0. Without it, a program that
exits just under the per-case limit made every case run: 3 cases cost about 26 s of the verifier's time at the
default limits, for one rollout. The cap is a time limit, so a rollout it ends (like one a case's time limit
ends) is `Scored.limited`: a node that scored it otherwise on its own machine is not taken for a liar.
"""

from __future__ import annotations

import json
import random
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from swarmrl.protocol.tasks import Problem, Scored, Task
from swarmrl.tasks.data import FileTaskOptions, load_split
from swarmrl.tasks.sandbox import Sandbox, SandboxConfig

MAX_CASES = 64
SCORE_CACHE = 4096  # distinct (program, tests) scores kept
TIME_SIGNALS = frozenset({128 + signal.SIGXCPU, 128 + signal.SIGKILL})
"""Exit codes of a run killed for its CPU time (SIGXCPU, then SIGKILL at the hard limit)."""
_FENCE = re.compile(r"```[A-Za-z0-9_+-]*[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


class CodeOptions(FileTaskOptions):
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="Limits of each test run.")
    rollout_sandbox_s: float = Field(15.0, gt=0, le=3600, description="Wall-clock seconds of sandbox runs one "
                                     "rollout may use across all its test cases; a rollout that spends them scores 0 "
                                     "(at least sandbox.wall_s: one case may use its whole limit).")

    @model_validator(mode="after")
    def _cap_fits_one_case(self) -> CodeOptions:
        if self.rollout_sandbox_s < self.sandbox.wall_s:
            raise ValueError(f"rollout_sandbox_s ({self.rollout_sandbox_s}) must be at least sandbox.wall_s "
                             f"({self.sandbox.wall_s}): one case may use its whole limit")
        return self


def extract_program(completion: str) -> str:
    """The last fenced code block of `completion` (an unclosed one at the end counts), else all of it."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def same_output(got: bytes, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and blank lines at the end."""
    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]
    return norm(got.decode("utf-8", errors="replace")) == norm(expected)


def parse_tests(raw: Any) -> list[dict[str, str]]:
    """Test cases as stored in a problem's answer; ValueError when they are not a 1..MAX_CASES list of
    {"input": str, "output": str}."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_CASES:
        raise ValueError(f"tests must be a list of 1 to {MAX_CASES} cases")
    cases = []
    for case in raw:
        if not (isinstance(case, dict) and set(case) == {"input", "output"}
                and all(isinstance(v, str) for v in case.values())):
            raise ValueError('each test case must be {"input": str, "output": str}')
        cases.append({"input": case["input"], "output": case["output"]})
    return cases


class CodeTask(Task):
    """Problems from `path`; held-out problems from `eval_path` or a seeded `eval_fraction` of `path`."""

    name = "code"
    Options = CodeOptions
    options: CodeOptions

    def __init__(self, options: CodeOptions, data_dir: Path):
        super().__init__(options, data_dir)
        self.sandbox = Sandbox(options.sandbox)  # refuses to load where code cannot be sandboxed
        self._cache: dict[tuple[str, str], Scored] = {}  # (program, tests) -> score, oldest first
        self._cache_lock = threading.Lock()
        self._train, self._eval = load_split(options, data_dir, self._parse)

    @staticmethod
    def _parse(record: dict[str, Any]) -> Problem:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("empty prompt")
        tests = parse_tests(record["tests"])
        solution = record.get("solution")
        if solution is not None and (not isinstance(solution, str) or not solution.strip()):
            raise ValueError("solution must be non-empty text")
        return Problem(prompt=prompt, answer=json.dumps(tests, sort_keys=True, separators=(",", ":")),
                       solution=solution)

    def sample(self, rng: random.Random) -> Problem:
        return self._train[rng.randrange(len(self._train))]

    def eval_set(self) -> list[Problem]:
        return list(self._eval)

    def reward(self, completion: str, answer: str) -> float:
        return self.scored(completion, answer).reward

    def scored(self, completion: str, answer: str) -> Scored:
        program = extract_program(completion)
        if not program.strip():
            return Scored(0.0)
        return self._score(program, answer)

    def _score(self, program: str, answer: str) -> Scored:
        # The rollouts of a group often write the same program (more so as the policy sharpens), and each run is a
        # fresh sandbox (tens of ms): score each distinct (program, tests) once. The score is a function of both
        # alone (up to the time limits, which `limited` says), so a cached one is the score.
        with self._cache_lock:
            cached = self._cache.get((program, answer))
        if cached is not None:
            return cached
        score = self._run_tests(program, answer)
        with self._cache_lock:
            self._cache[(program, answer)] = score
            while len(self._cache) > SCORE_CACHE:
                self._cache.pop(next(iter(self._cache)))
        return score

    def _run_tests(self, program: str, answer: str) -> Scored:
        tests = parse_tests(json.loads(answer))
        passed = 0
        deadline = time.monotonic() + self.options.rollout_sandbox_s
        for case in tests:
            left = deadline - time.monotonic()
            if left <= 0:  # the cap is spent: no more runs, whatever the cases left
                return Scored(0.0, limited=True)
            run = self.sandbox.run(program, case["input"].encode(), wall_s=left)
            if run.hit_limit:
                # Output and file-size limits count bytes (the same everywhere); time limits depend on the machine.
                return Scored(0.0, limited=run.status == "timeout" or run.returncode in TIME_SIGNALS)
            passed += run.ok and same_output(run.stdout, case["output"])
        return Scored(passed / len(tests))
