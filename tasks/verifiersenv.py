"""`verifiers`: the tasks of a verifiers (0.4) taskset as a swarmrl task, scored by the taskset's own `@vf.reward`
functions on the trusted side.

    [run.task]
    name = "verifiers"
    [run.task.options]
    taskset = "my-taskset"              # an installed verifiers taskset id, or "package.module:MyTaskset"
    config = { split = "train" }        # the taskset's config fields (its TasksetConfig subclass)
    size = 20000                        # tasks read from its load(): the held-out ones, then the training ones
    eval_size = 500

Prompts come from the taskset's `load()`, in its own order (a taskset must yield the same tasks in the same order on
every machine: checked when the task loads, see below). Tasks `0 .. eval_size - 1` are the held-out set (their
distinct prompts); training draws tasks `eval_size .. size - 1` whose prompt is not a held-out one.

What the coordinator stores as a problem's answer is the task's index and its content hash (verifiers' `Task.hash`,
cut to 16 hex digits), not the task's data. The verifier and the trainer load the taskset again from the signed
options, find the task by index, check the hash, and run its reward functions on a trace of the prompt and the
completion (the episode's last model turn): the row's reference fields never leave the trusted side. The reward is
the rewards' weighted sum divided by the sum of their positive weights (`normalize`), clamped to [0, 1].

Refused when the task loads, each with a one-line reason naming the option (docs/verifiers.md says why):
- a task that plugs judges (`TaskConfig.judges`) or whose config holds a model endpoint: an LLM judge cannot be
  replayed, and its verdict is whatever a remote model says;
- a reward that needs a `runtime` (a sandbox the rollout ran in), a task that needs a container or sets up or
  finalizes a runtime (`setup`, `finalize`, `stage_verifier`): the swarm runs no verifiers runtime;
- a reward that is not a coroutine function (verifiers awaits every reward: it could never score);
- a task whose prompt is empty (the user opens) or several messages; a system prompt is prepended to the prompt text,
  or refused (`system_prompt`);
- a taskset whose tasks or rewards differ in another process (another hash seed): `check_replay`.
A reward that reaches the network is not detected; an operator must not name one (docs/verifiers.md).

For a multi-turn run with the `verifiers_tools` environment (tasks/verifierstools.py), `toolset` names the same
toolset: each prompt then lists its tools and how to call them, since verifiers sends tools in a request field that
the swarm's prompts do not have.

`verifiers` (0.4.0) changes pins of this project's environment (openai, mcp), so it is not a dependency: it is imported
only when a run names this task, and a missing package is a one-line error saying how to install it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from swarmrl.protocol.tasks import EvalSettings, Problem
from swarmrl.tasks.heldout import IndexedTask
from swarmrl.tasks.verifierscommon import (
    VerifiersRefused,
    import_ref,
    import_verifiers,
    load_toolset,
    refusal_for_class,
    run_coroutine,
    tool_preamble,
)

REPLAY_CHECK_ITEMS = 16
"""Tasks of each range (held-out, training) loaded and scored again in another process when the task loads."""
PROBE_COMPLETIONS = ("", "0", "The answer is 42.")
"""Completions every checked task is scored on in the replay check (with the task's `answer` field, if it has one)."""
_HOOKS_OFF = ("setup", "finalize", "stage_verifier")


class VerifiersOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    taskset: str = Field(min_length=1, description="An installed verifiers taskset id (verifiers' own loader), or "
                         "'package.module:Class' naming a vf.Taskset subclass.")
    config: dict[str, Any] = Field(default_factory=dict, description="The taskset's config fields (its "
                                   "TasksetConfig subclass; `id` is the taskset option).")
    size: int = Field(100_000, ge=2, description="Tasks read from the taskset (fewer if it has fewer): the held-out "
                      "ones, then the training ones. Every trusted role holds them in memory.")
    eval_size: int = Field(200, ge=1, description="Tasks held out (the first ones); the held-out set is their "
                           "distinct prompts.")
    system_prompt: Literal["prepend", "refuse"] = Field(
        "prepend", description="A task's system prompt: prepended to its prompt text (the swarm renders a prompt as "
        "one user message with the run's chat template), or refused.")
    toolset: str | None = Field(None, description="'package.module:Class' of the vf.Toolset the run's "
                                "verifiers_tools environment serves: the prompt then lists its tools and how to call "
                                "them (verifiers sends tools in a request field the swarm's prompts do not have).")
    toolset_config: dict[str, Any] = Field(default_factory=dict, description="That toolset's config fields (the "
                                           "environment's `config`).")
    normalize: bool = Field(True, description="Divide the rewards' weighted sum by the sum of their positive weights.")
    max_new_tokens: int = Field(64, ge=1, le=4096, description="Greedy completion length (of each model turn) for "
                                "held-out evaluation.")
    max_turns: int = Field(1, ge=1, le=16, description="Model turns of a held-out episode: the run's max_turns, "
                           "when it plays an environment (verifiers_tools).")

    @model_validator(mode="after")
    def _room_to_train(self) -> VerifiersOptions:
        if self.eval_size >= self.size:
            raise ValueError(f"eval_size {self.eval_size} leaves none of the {self.size} tasks to train on")
        return self


def load_taskset(options: VerifiersOptions) -> Any:
    """The taskset the options name, built with its validated config."""
    vf = import_verifiers()
    if ":" in options.taskset:
        cls = import_ref(options.taskset, "taskset")
        if not (isinstance(cls, type) and issubclass(cls, vf.Taskset)):
            raise VerifiersRefused(f"[run.task.options] taskset: {options.taskset!r} is not a verifiers Taskset "
                                   f"subclass{refusal_for_class(cls)}")
        from verifiers.v1.utils.generic import concrete_type

        config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        build = cls
    else:
        from verifiers.v1.utils.loaders import taskset_class, taskset_config_type

        try:
            build, config_cls = taskset_class(options.taskset), taskset_config_type(options.taskset)
        except (ImportError, TypeError, AttributeError, ValueError) as e:
            raise VerifiersRefused(f"[run.task.options] taskset: verifiers cannot load {options.taskset!r}: "
                                   f"{e}") from None
    try:
        config = config_cls.model_validate({**options.config, "id": options.taskset})
    except ValueError as e:
        raise VerifiersRefused(f"[run.task.options] config: the taskset refuses it: {e}".replace("\n", " ")) from None
    return build(config)


def task_refusal(task: Any) -> str | None:
    """Why the swarm cannot score `task` (a verifiers Task) by its class and config, or None."""
    vf = import_verifiers()
    from verifiers.v1.clients import BaseClientConfig

    kind = type(task).__name__
    if task.config.judges:
        ids = [j.id for j in task.config.judges]
        return (f"config: task {kind} plugs judges {ids}: an LLM judge asks a model over the network, so its "
                "verdict can be neither replayed nor trusted")
    endpoints = [name for name, value in task.config if isinstance(value, BaseClientConfig)]
    if endpoints:
        return (f"config: task {kind}'s config holds model endpoints {endpoints} (a judge called by its code): "
                "a model's verdict can be neither replayed nor trusted")
    if task.NEEDS_CONTAINER:
        return f"taskset: task {kind} needs a container, which the swarm does not run"
    overridden = [h for h in _HOOKS_OFF if getattr(type(task), h) is not getattr(vf.Task, h)]
    if overridden:
        return (f"taskset: task {kind} overrides {overridden}: it prepares or reads a sandbox runtime around the "
                "rollout, which the swarm does not run, so its rewards could not be computed the same way")
    rewards = task.hooks("reward")
    if not rewards:
        return f"taskset: task {kind} has no @vf.reward functions to score with"
    for fn in rewards:
        if "runtime" in inspect.signature(fn).parameters:
            return (f"taskset: reward {fn.__name__!r} of task {kind} reads the rollout's runtime (a sandbox), which "
                    "the swarm does not run")
        if not inspect.iscoroutinefunction(inspect.unwrap(fn)):
            return (f"taskset: reward {fn.__name__!r} of task {kind} is not async: verifiers awaits every reward, "
                    "so it cannot score (write it `async def`)")
    return None


def row_refusal(index: int, task: Any, options: VerifiersOptions) -> str | None:
    """Why the swarm cannot lease task `index` (its row), or None."""
    data = task.data
    if data.image:
        return f"taskset: task {index} names a container image, which the swarm does not run"
    if data.prompt is None:
        return f"taskset: task {index} has no prompt (the user opens the conversation): nothing to lease to a node"
    if not isinstance(data.prompt, str) and (len(data.prompt) != 1 or data.prompt[0].role != "user"):
        return (f"taskset: task {index}'s prompt is messages {[m.role for m in data.prompt]}; the swarm renders a "
                "prompt as one user message with the run's chat template")
    if data.system_prompt and options.system_prompt == "refuse":
        return f"system_prompt: task {index} has a system prompt, and the option refuses those"
    return None


class VerifiersTask(IndexedTask):
    """Tasks of a verifiers taskset, loaded again from the signed options on every role (module docstring)."""

    name = "verifiers"
    Options = VerifiersOptions
    options: VerifiersOptions

    def __init__(self, options: VerifiersOptions, data_dir: Path | None = None, check: bool = True):
        super().__init__(options, data_dir or Path.cwd())
        self._tasks = loaded_tasks(options)
        self._preamble = Preamble(options)
        if len(self._tasks) <= options.eval_size:
            raise VerifiersRefused(f"[run.task.options] eval_size: {options.eval_size} leaves none of the taskset's "
                                   f"{len(self._tasks)} tasks to train on")
        # A taskset yields one task class (verifiers' rule), so its class is checked once, and every row.
        why = task_refusal(self._tasks[0]) or next(
            (w for i, t in enumerate(self._tasks) if (w := row_refusal(i, t, options))), None)
        if why:
            raise VerifiersRefused(f"[run.task.options] {why}")
        if check:
            check_replay(options)

    def _problem(self, index: int) -> Problem:
        task = self._tasks[index]
        return Problem(prompt=self._preamble.prompt(task), answer=f"{index}:{task.hash[:16]}")

    def _items(self) -> int:
        return len(self._tasks)

    def task(self, answer: str) -> Any:
        """The verifiers task a stored answer (`"<index>:<hash>"`) names, checked against its hash."""
        index, _, digest = answer.partition(":")
        if not (index.isdigit() and int(index) < len(self._tasks)):
            raise ValueError(f"verifiers: {answer!r} is not an answer this task stored")
        task = self._tasks[int(index)]
        if task.hash[:16] != digest:
            raise RuntimeError(f"verifiers: task {index} loads differently than when it was drawn (another taskset "
                               "version or options on this machine?)")
        return task

    def reward(self, completion: str, answer: str) -> float:
        """The task's rewards on a trace of its prompt and `completion` (module docstring), in [0, 1]; 0 when a
        reward raises on the completion."""
        task = self.task(answer)
        return score(task, self._preamble.prompt(task), completion, self.options.normalize)

    @property
    def eval_settings(self) -> EvalSettings:
        return EvalSettings(max_new_tokens=self.options.max_new_tokens, max_turns=self.options.max_turns)


def loaded_tasks(options: VerifiersOptions) -> list[Any]:
    """The first `size` tasks of the taskset, in its order."""
    taskset = load_taskset(options)
    return list(taskset.take(options.size))


class Preamble:
    """What a leased prompt is made of besides the task's prompt text: its system prompt, and the tools it may call."""

    def __init__(self, options: VerifiersOptions):
        self.tools = None
        if options.toolset is not None:
            self.tools = tool_preamble(load_toolset(options.toolset, options.toolset_config, "[run.task.options]"))

    def prompt(self, task: Any) -> str:
        """The text a node is leased: the task's system prompt, the tools, its prompt's text (blank lines between)."""
        data = task.data
        return "\n\n".join(part for part in (data.system_prompt, self.tools, data.prompt_text) if part)


def score(task: Any, prompt: str, completion: str, normalize: bool = True) -> float:
    """`task`'s `@vf.reward` functions on a trace of `prompt` and one assistant reply `completion`: their weighted
    sum (divided by the positive weights' sum when `normalize`), clamped to [0, 1]; 0 if one raises."""
    vf = import_verifiers()
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, TraceTask
    from verifiers.v1.utils.decorators import invoke_all

    trace = vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        state=state_cls(type(task))(),
        agent=AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig()), name="swarmrl", trainable=False),
        nodes=[MessageNode(message=vf.UserMessage(content=prompt)),
               MessageNode(parent=0, message=vf.AssistantMessage(content=completion), sampled=True)])
    rewards = task.hooks("reward")
    total, weights = 0.0, 0.0
    try:
        results = run_coroutine(invoke_all(rewards, {"task": task.data, "trace": trace}))
        for fn, result in zip(rewards, results, strict=True):
            weight = float(getattr(fn, "_vf_weight", 1.0))
            for value in result.values() if isinstance(result, dict) else [result]:  # keyed scores: each counts
                total += float(value) * weight
                weights += max(weight, 0.0)
    except Exception:  # (a reward's parse error on hostile text, or a value that is no number: a wrong answer)
        return 0.0
    out = total / weights if normalize and weights > 0 else total
    return min(max(out, 0.0), 1.0) if math.isfinite(out) else 0.0


def check_indices(options: VerifiersOptions, n_tasks: int) -> list[int]:
    """The tasks loaded and scored twice (here and in another process) when the task loads: the first held-out and
    training tasks, and as many training tasks spread by a fixed seed."""
    k, lo = REPLAY_CHECK_ITEMS, options.eval_size
    first = list(range(min(k, lo))) + list(range(lo, min(n_tasks, lo + k)))
    rng = random.Random(0)
    return first + sorted(rng.randrange(lo, n_tasks) for _ in range(k))


def replay_facts(options: VerifiersOptions) -> dict[str, Any]:
    """What another process must find the same: the number of tasks, and for each checked task its hash, prompt
    text and rewards of the probe completions."""
    tasks, preamble = loaded_tasks(options), Preamble(options)
    out: dict[str, Any] = {"n": len(tasks)}
    for i in check_indices(options, len(tasks)):
        task = tasks[i]
        probes = list(PROBE_COMPLETIONS)
        answer = getattr(task.data, "answer", None)
        if isinstance(answer, str):
            probes.append(answer)
        prompt = preamble.prompt(task)
        out[str(i)] = [task.hash, hashlib.sha256(prompt.encode()).hexdigest()[:16],
                       [score(task, prompt, p, options.normalize) for p in probes]]
    return out


_REPLAYED: set[str] = set()


def check_replay(options: VerifiersOptions) -> None:
    """Refuse (VerifiersRefused) a taskset whose tasks, prompts or rewards differ between two loads here, or between
    this process and another with another hash seed: the verifier could not load or score what the coordinator drew."""
    key = options.model_dump_json()
    if key in _REPLAYED:
        return
    here = replay_facts(options)
    if here != replay_facts(options):
        raise VerifiersRefused("[run.task.options] taskset: its tasks or rewards differ between two loads in one "
                               "process (a clock, a random source of its own, a shuffle without a seed)")
    hash_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    proc = subprocess.run([sys.executable, "-m", "swarmrl.tasks.verifiersenv"], input=key, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONHASHSEED": hash_seed})
    if proc.returncode != 0:
        raise RuntimeError(f"the verifiers taskset's replay check failed to run: {proc.stderr.strip()[-2000:]}")
    there = json.loads(proc.stdout)
    for i in here:
        if there.get(i) != here[i]:
            what = "task count" if i == "n" else f"task {i}"
            raise VerifiersRefused(f"[run.task.options] taskset: its {what} loads or scores differently in another "
                                   "process (another hash seed: the order of a set or a dict of strings), so the "
                                   "verifier could not replay what the coordinator drew")
    _REPLAYED.add(key)


def main() -> None:
    """The replay check's other process: options JSON on stdin, `replay_facts` as JSON on stdout."""
    print(json.dumps(replay_facts(VerifiersOptions.model_validate_json(sys.stdin.read()))))


if __name__ == "__main__":
    main()
