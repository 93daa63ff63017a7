"""`reasoning_gym`: procedural problems from reasoning-gym's generators, scored by reasoning-gym's own scorers.

    [run.task]
    name = "reasoning_gym"
    [run.task.options]
    seed = 42
    size = 100000
    eval_size = 500
    datasets.chain_sum = { weight = 3, config = { min_terms = 2, max_terms = 2, max_digits = 2 } }
    datasets.basic_arithmetic = { weight = 1, config = { max_terms = 2, max_digits = 1 } }

No data file travels. The options name reasoning-gym datasets, their weights and configs, and one seed; every
role builds the same `CompositeDataset` from them (reasoning-gym's own weighted mixture: item `i` picks a dataset
with `Random(seed + i)`, and the `k`-th dataset in order of name generates from seed `seed + k + 1`; ordered by
name, so that no serialisation of the run description can change the mixture). Items `0 .. eval_size - 1` are the
held-out set (their distinct questions); training draws items `eval_size .. size - 1` whose question is not a
held-out one.

What the coordinator stores as a problem's answer is the item's index and a digest of the item it generated
(`"<index>:<digest>"`), not the answer text. The verifier and the trainer regenerate the item from the signed
options and that index, check the digest (the item they score is the one the node was shown), and score the
completion with the item's own dataset's `score_answer(answer, entry)`: its reference answer and metadata never
leave the trusted side, and there is nothing to swap.

Replay is checked when the task loads: a subprocess with another hash seed generates items of both ranges, and
a dataset whose items differ there (set iteration order, global random state) is refused with its name, since
the verifier could not regenerate what the coordinator drew. Of reasoning-gym 0.1.25's 105 datasets, 5 are refused
so with their default configs (isomorphic_strings, knight_swap, polynomial_multiplication, ransom_note,
word_ladder: their items change with the hash seed).

`answer_format`: "plain" scores the completion's stripped text (what a small model trained on bare answers
writes); "tagged" scores the text of its last `<answer>...</answer>` (reasoning-gym's `extract_answer`, the format
its prompts ask larger models for), and a completion without one scores 0.

Datasets whose scorer runs the completion as Python (`UNSAFE_SCORERS`, 9 of 105) are refused with that reason.
Scorers run in the calling thread, on the completion's last `MAX_ANSWER_CHARS` characters; one that raises scores 0.
Unlike the `math` task's checker (`swarmrl.tasks.mathcheck`), no worker process bounds their time: the arithmetic
scorers compare decimals, but a dataset whose scorer parses with sympy could be slow on hostile text.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from swarmrl.protocol.tasks import Problem
from swarmrl.runtime.errors import UserError
from swarmrl.tasks.heldout import IndexedTask
from swarmrl.tasks.templates import question_template

REPLAY_CHECK_ITEMS = 32
"""Items of each range (held-out, training) generated again in another process when the task loads."""
ENTRY_CACHE = 4096
"""Regenerated items kept (a group's rollouts, and the held-out set, score against the same item many times)."""
MAX_ANSWER_CHARS = 4096
"""A completion's scored text is cut to its last this many characters (scorers parse what they are given)."""
UNSAFE_SCORERS = frozenset({"binary_matrix", "countdown", "intermediate_integration", "n_queens",
                            "polynomial_multiplication", "puzzle24", "simple_integration", "spiral_matrix",
                            "string_insertion"})
"""reasoning-gym 0.1.25 datasets whose `score_answer` runs the answer text as Python (`eval`, `sympy.parse_expr`): a
model's completion would execute on the verifier, so they are refused. tests/test_reasoning_gym_task.py probes every
dataset's scorer and requires exactly these to execute code."""
_STORED = re.compile(r"([0-9]{1,18}):([0-9a-f]{16})")


class MixtureRefused(UserError, ValueError):
    """The options' mixture cannot be used in a swarm (a dataset refuses its config, or does not replay): the
    operator's to fix in `[run.task.options]`, said in one line (a ValueError too, as `load_task` promises)."""


class DatasetChoice(BaseModel):
    """One reasoning-gym dataset in the mixture (its name is its key in `datasets`)."""

    model_config = ConfigDict(extra="forbid")

    weight: float = Field(1.0, gt=0, description="Its share of the items, relative to the other datasets' weights.")
    config: dict[str, Any] = Field(default_factory=dict, description="Its config's fields (reasoning-gym's config "
                                   "dataclass for the dataset); not seed or size, which the task derives.")

    @field_validator("config")
    @classmethod
    def _no_seed_or_size(cls, config: dict[str, Any]) -> dict[str, Any]:
        taken = sorted({"seed", "size"} & set(config))
        if taken:
            raise ValueError(f"config sets {taken}: the task's own seed and size fix them for every dataset")
        return config


class ReasoningGymOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    datasets: dict[str, DatasetChoice] = Field(
        min_length=1, description="The datasets mixed, by reasoning-gym name (e.g. chain_sum), with weights and "
        "configs (a table keyed by name: each dataset once).")
    seed: int = Field(0, ge=0, description="Seed of the whole mixture: every item follows from it and its index.")
    size: int = Field(1_000_000, ge=2, description="Items in the mixture: the held-out ones, then the training ones.")
    eval_size: int = Field(500, ge=1, description="Items held out (the first ones); the held-out set is their "
                           "distinct questions.")
    template: str = Field("{question}", description="Prompt text; `{question}` is replaced by the item's question.")
    answer_format: Literal["plain", "tagged"] = Field(
        "plain", description="plain: the whole completion is the answer; tagged: its last <answer>...</answer>.")
    max_new_tokens: int = Field(32, ge=1, le=4096, description="Greedy completion length for held-out evaluation.")

    @field_validator("datasets")
    @classmethod
    def _known(cls, datasets: dict[str, DatasetChoice]) -> dict[str, DatasetChoice]:
        from reasoning_gym.factory import DATASETS

        unknown = sorted(set(datasets) - set(DATASETS))
        if unknown:
            raise ValueError(f"unknown reasoning-gym dataset(s) {unknown}; known: {sorted(DATASETS)}")
        unsafe = sorted(set(datasets) & UNSAFE_SCORERS)
        if unsafe:
            raise ValueError(f"reasoning-gym dataset(s) {unsafe}: the scorer runs the completion as Python code "
                             "(eval or sympy.parse_expr), so a model's text would execute on the verifier; remove "
                             "them from the task's datasets")
        return dict(sorted(datasets.items()))  # the mixture's order (seeds) is by name, however they were written

    @field_validator("template")
    @classmethod
    def _has_question(cls, template: str) -> str:
        return question_template(template)

    @model_validator(mode="after")
    def _room_to_train(self) -> ReasoningGymOptions:
        if self.eval_size >= self.size:
            raise ValueError(f"eval_size {self.eval_size} leaves none of the {self.size} items to train on")
        return self


def build_mixture(options: ReasoningGymOptions) -> Any:
    """reasoning-gym's `CompositeDataset` of `options`; ValueError naming the dataset whose config it refuses."""
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    specs = [DatasetSpec(name, d.weight, dict(d.config)) for name, d in sorted(options.datasets.items())]
    try:
        return CompositeDataset(CompositeConfig(size=options.size, seed=options.seed, datasets=specs))
    except (AssertionError, TypeError, ValueError) as e:
        # Which dataset: build each alone with the same config to name the one that refuses it.
        from reasoning_gym import create_dataset

        for name, d in sorted(options.datasets.items()):
            try:
                create_dataset(name, **d.config)
            except (AssertionError, TypeError, ValueError) as bad:
                raise MixtureRefused(f"[run.task.options] datasets.{name}: reasoning-gym refuses config {d.config}: "
                                     f"{bad!r}") from None
        raise MixtureRefused(f"[run.task.options] datasets: reasoning-gym refuses the mixture: {e!r}") from None


def item_digest(entry: dict[str, Any]) -> str:
    """16 hex digits naming an item's question and reference answer."""
    text = json.dumps([entry["question"], entry["answer"]], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_indices(options: ReasoningGymOptions) -> list[int]:
    """The items generated twice (here and in another process) when the task loads: the first held-out and
    training items, and as many training items spread by the seed."""
    rng = random.Random(options.seed)
    n = REPLAY_CHECK_ITEMS
    first = list(range(min(n, options.eval_size))) + list(range(options.eval_size, min(options.size,
                                                                                     options.eval_size + n)))
    return first + sorted(rng.randrange(options.eval_size, options.size) for _ in range(n))


def digests(options: ReasoningGymOptions) -> dict[int, tuple[str, str]]:
    """{index: (source dataset, digest)} of `check_indices(options)`."""
    mixture = build_mixture(options)
    out = {}
    for i in check_indices(options):
        entry = mixture[i]
        out[i] = (entry["metadata"]["source_dataset"], item_digest(entry))
    return out


_REPLAYED: set[str] = set()
"""Options (JSON) whose mixture passed `check_replay` in this process: the result depends on them and the installed
packages only, so a task loaded again with them (tests, a role that reloads) is not checked again."""


def check_replay(options: ReasoningGymOptions) -> None:
    """Refuse (ValueError, naming the dataset) a mixture whose items another process generates differently."""
    key = options.model_dump_json()
    if key in _REPLAYED:
        return
    here = digests(options)
    # Another hash seed than ours, so that an order of sets or dicts of strings that differs shows.
    hash_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    proc = subprocess.run([sys.executable, "-m", "swarmrl.tasks.reasoninggym"], input=key,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"reasoning-gym's replay check failed to run: {proc.stderr.strip()[-2000:]}")
    there = {int(i): tuple(v) for i, v in json.loads(proc.stdout).items()}
    for i, (name, digest) in here.items():
        if there.get(i) != (name, digest):
            raise MixtureRefused(f"[run.task.options] datasets.{name}: reasoning-gym dataset {name!r} does not "
                                 f"generate item {i} the same way in two processes, so the verifier could not "
                                 "regenerate what the coordinator drew: remove it from the datasets")
    _REPLAYED.add(key)


class ReasoningGymTask(IndexedTask):
    """Items of a reasoning-gym mixture, regenerated from the signed options on every role (module docstring)."""

    name = "reasoning_gym"
    Options = ReasoningGymOptions
    options: ReasoningGymOptions

    def __init__(self, options: ReasoningGymOptions, data_dir: Path | None = None):
        super().__init__(options, data_dir or Path.cwd())
        self._mixture = build_mixture(options)
        self._lock = threading.Lock()  # reasoning-gym's datasets are not documented as thread-safe
        self._entries: OrderedDict[int, dict[str, Any]] = OrderedDict()
        check_replay(options)

    def _entry(self, index: int) -> dict[str, Any]:
        with self._lock:
            entry = self._entries.get(index)
            if entry is None:
                entry = self._entries[index] = self._mixture[index]
                while len(self._entries) > ENTRY_CACHE:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(index)
            return entry

    def _problem(self, index: int) -> Problem:
        entry = self._entry(index)
        solution = entry["answer"] if self.options.answer_format == "plain" else f"<answer>{entry['answer']}</answer>"
        return Problem(prompt=self.options.template.format(question=entry["question"]),
                       answer=f"{index}:{item_digest(entry)}", solution=solution)

    def _items(self) -> int:
        return self.options.size

    def entry(self, answer: str) -> dict[str, Any]:
        """The item a stored answer (`"<index>:<digest>"`) names, regenerated and checked against its digest."""
        stored = _STORED.fullmatch(answer)
        if stored is None or int(stored[1]) >= self.options.size:
            raise ValueError(f"reasoning_gym: {answer!r} is not an answer this task stored")
        entry = self._entry(int(stored[1]))
        if item_digest(entry) != stored[2]:
            raise RuntimeError(f"reasoning_gym: item {stored[1]} regenerates differently than when it was drawn "
                               "(another reasoning-gym version or options on this machine?)")
        return entry

    def reward(self, completion: str, answer: str) -> float:
        """reasoning-gym's score of the completion's answer for the item `answer` names, in [0, 1]; 0 for a
        completion its scorer cannot read (a scorer that raises on it)."""
        entry = self.entry(answer)
        text: str | None = completion[-MAX_ANSWER_CHARS:].strip()
        if self.options.answer_format == "tagged":
            from reasoning_gym.utils import extract_answer

            text = extract_answer(completion[-MAX_ANSWER_CHARS:])
        try:
            score = float(self._mixture.score_answer(text, entry))
        except Exception:  # (a scorer's parse error on hostile text is a wrong answer, not ours)
            return 0.0
        return min(max(score, 0.0), 1.0) if score == score else 0.0  # NaN scores 0


def main() -> None:
    """The replay check's other process: options JSON on stdin, `digests` as JSON on stdout."""
    options = ReasoningGymOptions.model_validate_json(sys.stdin.read())
    print(json.dumps({str(i): list(v) for i, v in digests(options).items()}))


if __name__ == "__main__":
    main()
