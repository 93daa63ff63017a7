"""Tasks: where prompts come from and how a completion is scored. The interface only.

A task is a family of prompts with answers a program can check. The coordinator draws training prompts and
keeps each answer in its database; the verifier scores completions against that answer on the trusted side;
the trainer measures accuracy on the task's held-out set. A node sees prompts only, never an answer.

A run names its task with a `TaskSpec` (a name and the task's options, in the run's TOML):

    [task]
    name = "math"
    options = { path = "gsm8k.jsonl", sha256 = "9f2c...", max_new_tokens = 384 }

`task = "addition"` (a bare name) is accepted too. `load_task(spec)` finds the class registered under
that name in the entry-point group `swarmrl.tasks`, validates the options against its `Options` model and
builds it. The built-in tasks (`swarmrl.tasks`: addition, math, code) register there the same way any
other package does.

Writing a task of your own, in your own package, without editing this project:

    # mypkg/tasks.py
    from pydantic import BaseModel, ConfigDict, Field
    from swarmrl.protocol.tasks import EvalSettings, Problem, Task

    class Reverse(Task):
        name = "reverse"

        class Options(BaseModel):
            model_config = ConfigDict(extra="forbid")
            length: int = Field(6, ge=1, description="Letters per word.")

        def sample(self, rng):              # training prompts; never one of eval_set()
            ...
        def eval_set(self):                 # fixed held-out problems
            ...
        def reward(self, completion, answer):
            return float(completion.strip() == answer)

    # mypkg's pyproject.toml
    [project.entry-points."swarmrl.tasks"]
    reverse = "mypkg.tasks:Reverse"

After `pip install mypkg`, `name = "reverse"` selects it in every role. Install it on every machine that
loads the task (coordinator, verifier, trainer), in the same version.

Data files. A task that reads a file takes its path in its options, and the file's SHA-256 too. A relative
path resolves against the `data_dir` the loading role passes to `load_task` (the roles pass none today: their
working directory), so each machine keeps its own copy where it likes, while the run's options stay the
same everywhere; the task refuses a file whose content hashes differently. The coordinator, verifier and
trainer thereby use byte-identical data or do not start. (`swarmrl.tasks.data` does this for JSONL files.)

Only the standard library and pydantic are imported here.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from swarmrl.protocol.pydantic_errors import describe_validation_error

ENTRY_POINT_GROUP = "swarmrl.tasks"


class TaskSpec(BaseModel):
    """Which task a run trains on, and its options: part of the run description every role reads.

    A bare string is read as `{name = "..."}`, so `task = "addition"` in TOML (or `--set task=addition`) works.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("addition", min_length=1, max_length=64,
                      description="A task registered in the entry-point group 'swarmrl.tasks'.")
    options: dict[str, Any] = Field(default_factory=dict, description="The task's own options (its Options model).")

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data


@dataclass(frozen=True)
class Problem:
    """One prompt and what its reward needs.

    `answer` is opaque text that only the task understands (a number, an expression, the JSON of unit
    tests). It stays on the trusted side: stored by the coordinator, sent to the verifier, never to a node.
    """

    prompt: str
    answer: str
    solution: str | None = None
    """A completion that earns full reward (the answer itself, a reference program), for supervised warm starts
    (`trainer.warmup`); None when the task has none. Never used for rewards, and never sent to a node."""
    solution_turns: tuple[str, ...] | None = None
    """For a multi-turn task: the reference episode's model turns (the environment answers between them), which the
    warm start trains on instead of `solution`."""


@dataclass(frozen=True)
class Scored:
    """A trusted reward, and whether a time or cost limit decided it (`Task.scored`)."""

    reward: float
    limited: bool = False
    """A limit that depends on the machine (wall-clock or CPU time, a per-rollout cost cap) ended the scoring: the
    same completion may score otherwise elsewhere, so a node's claimed reward that differs proves nothing. The
    reward still stands: it is what the trainer gets."""


class EvalSettings(BaseModel):
    """How the trainer evaluates a task: settings that belong to the task, not to the trainer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(ge=1, description="Greedy completion length cap for held-out evaluation (of each "
                                "model turn, in a multi-turn task).")
    max_turns: int = Field(1, ge=1, description="Model turns of a held-out episode: the run's sampling.max_turns, "
                           "for a task played against an environment.")


class NoOptions(BaseModel):
    """The options model of a task that takes none."""

    model_config = ConfigDict(extra="forbid")


class Task(ABC):
    """A family of prompts with checkable answers. Subclasses set `name` and `Options`, and implement
    `sample`, `eval_set` and `reward`.

    Every method may be called many times and from any thread; `reward` and `is_correct` run on the
    trusted side with model-written text, which must be treated as hostile: they return a score for any
    string (garbage scores 0) and do not hang on it. They raise only when the task itself cannot work (a
    broken sandbox, say), never because of what the completion says.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type[BaseModel]] = NoOptions

    def __init__(self, options: BaseModel, data_dir: Path):
        """`options`: a validated `Options`; `data_dir`: where relative data paths in them are resolved."""
        self.options = options
        self.data_dir = data_dir

    @abstractmethod
    def sample(self, rng: random.Random) -> Problem:
        """A training problem drawn with `rng` (the same `rng` state gives the same problem). Never a problem
        of `eval_set()`, so held-out accuracy measures generalisation, not memory."""

    @abstractmethod
    def eval_set(self) -> Sequence[Problem]:
        """The fixed held-out problems, in a fixed order (every call and every machine: the same list)."""

    @abstractmethod
    def reward(self, completion: str, answer: str) -> float:
        """The trusted reward in [0, 1] of `completion` (decoded text, hostile) for a problem whose answer is
        `answer`. Deterministic: the verifier recomputes it and compares with what a node claims."""

    def scored(self, completion: str, answer: str) -> Scored:
        """`reward`, and whether a machine-dependent limit decided it. The default: never (a task whose reward is a
        pure function of the text). Tasks that bound their work by time override this."""
        return Scored(self.reward(completion, answer))

    def is_correct(self, completion: str, answer: str) -> bool:
        """Whether `completion` solves the problem outright (held-out accuracy counts these): full reward."""
        return self.reward(completion, answer) >= 1.0

    @property
    def eval_settings(self) -> EvalSettings:
        """Evaluation settings from the task and its options: here, the option `max_new_tokens` if the task
        has one, else 32. Override for anything else."""
        return EvalSettings(max_new_tokens=getattr(self.options, "max_new_tokens", 32))

    def close(self) -> None:  # noqa: B027 (an optional hook: most tasks hold nothing)
        """Release what the task holds (worker processes, say). Safe to call twice."""


def registered_tasks() -> dict[str, str]:
    """Task names registered in the `swarmrl.tasks` entry-point group, each with its 'module:Class'."""
    found: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if found.setdefault(ep.name, ep.value) != ep.value:
            # Two packages claim one name: refuse rather than let install order pick whose task a run gets.
            raise ValueError(f"task {ep.name!r} is registered twice: {found[ep.name]!r} and {ep.value!r}")
    return found


def task_class(name: str) -> type[Task]:
    """The Task subclass registered as `name`; ValueError naming the known tasks if there is none."""
    known = registered_tasks()
    if name not in known:
        raise ValueError(f"unknown task {name!r}; known: {sorted(known)} (entry-point group {ENTRY_POINT_GROUP!r})")
    cls = next(e for e in entry_points(group=ENTRY_POINT_GROUP) if e.name == name).load()
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"task {name!r} ({known[name]}) is not a swarmrl.protocol.tasks.Task subclass")
    return cls


def task_options(spec: TaskSpec) -> BaseModel:
    """`spec.options` validated by the task's Options model, without building the task (no data is read):
    for checking a config early. ValueError for an unknown task or options it refuses."""
    cls = task_class(spec.name)
    try:
        return cls.Options.model_validate(spec.options)
    except ValidationError as e:
        raise ValueError(f"task {spec.name!r}: bad options: {describe_validation_error(e, root='options')}") from None


def load_task(spec: TaskSpec, data_dir: Path | str | None = None) -> Task:
    """The task `spec` names, built with its validated options.

    `data_dir` (default: the working directory) is where the task resolves relative data paths. Raises
    ValueError naming the known tasks for an unknown name, and ValueError for options the task refuses;
    a task may raise more at construction (a data file whose hash differs, a sandbox that cannot run).
    """
    options = task_options(spec)
    return task_class(spec.name)(options, Path(data_dir) if data_dir is not None else Path.cwd())
