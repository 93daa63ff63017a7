"""Multi-turn episodes: model turns and environment turns in one rollout, every one replayable by the trusted side.

An episode starts from the leased prompt. The model writes a turn (sampled by the protocol's rule, ended by a stop
token); the run's environment answers it with text (`Environment.respond`), which is tokenized as the next user
message of the chat (`models.prompts.render_env_turn`); the model writes the next turn, and so on, until the
environment answers None, the run's turn limit is reached, or a turn runs out of tokens. The rollout's
`completion_ids` hold every turn, in order; `Rollout.turns` their lengths, alternating model and environment and
starting and ending with a model turn (empty: one model turn, the single-turn case).

What keeps it honest. The environment is a pure function of (prompt text, the model's turns as decoded text, the
rollout's seed): the verifier runs it itself on the node's model turns and requires the node's environment tokens
to be exactly what it renders, so a node can neither fake an observation nor drop or add a turn. Model turn k is
sampled with `protocol.sampling.turn_seed(seed, k)` at positions 0, 1, ... of that turn, so the verifier replays
every model token as it does a single-turn completion. A node claims logprob 0.0 for environment tokens (they were
not sampled), and the trainer's loss leaves them out.

An environment that cannot be replayed (it reads a clock, the network, a random source of its own, or iterates a
set of strings) is refused when it loads: `check_replay` runs it on probe transcripts here and in a second process
with another hash seed, and compares.

Environments register in the entry-point group `swarmrl.environments`, as tasks do in `swarmrl.tasks`; the run
names one in `[run.environment]`. Only the standard library and pydantic are imported here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarmrl.protocol.pydantic_errors import describe_validation_error

ENTRY_POINT_GROUP = "swarmrl.environments"
MAX_TURNS = 16
"""Most model turns an episode may have (a run's `sampling.max_turns` is at most this)."""
MAX_REPLY_CHARS = 4096
"""Longest environment reply, in characters: a longer one is cut here by every role alike."""


class EnvironmentSpec(BaseModel):
    """Which environment answers the model's turns, and its options: part of the run description."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64,
                      description="An environment registered in the entry-point group 'swarmrl.environments'.")
    options: dict[str, Any] = Field(default_factory=dict, description="The environment's own options.")


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Environment(ABC):
    """Answers a model's turns. Subclasses set `name` and `Options` and implement `respond`.

    `respond` runs on nodes and on the trusted side with model-written text, which is hostile: it answers any string
    (an error message is an answer) within bounded time and memory, and never raises because of what a turn says.
    It must be a pure function of its arguments: same arguments, same reply, in every process on every machine.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type[BaseModel]] = NoOptions
    probes: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = (("What is 2 + 3?", ("5",)),)
    """(prompt, model turns) transcripts `check_replay` runs the environment on; give ones that reach its code paths."""

    def __init__(self, options: BaseModel):
        self.options = options

    @abstractmethod
    def respond(self, prompt: str, turns: Sequence[str], seed: int) -> str | None:
        """The environment's reply to the model's turns so far (`turns`, decoded text, oldest first), or None when
        the episode ends here. `prompt` is the leased prompt's text; `seed` the rollout's leased seed (for an
        environment with randomness of its own, which must come from it)."""

    def reply(self, prompt: str, turns: Sequence[str], seed: int) -> str | None:
        """`respond`, cut to MAX_REPLY_CHARS: what every role uses."""
        out = self.respond(prompt, turns, seed)
        return None if out is None else str(out)[:MAX_REPLY_CHARS]


def environment_class(name: str) -> type[Environment]:
    """The Environment subclass registered as `name`; ValueError naming the known ones if there is none."""
    found = [e for e in entry_points(group=ENTRY_POINT_GROUP) if e.name == name]
    if not found:
        known = sorted({e.name for e in entry_points(group=ENTRY_POINT_GROUP)})
        raise ValueError(f"[run.environment] name: unknown environment {name!r}; known: {known}")
    if len({e.value for e in found}) > 1:
        raise ValueError(f"environment {name!r} is registered twice: {sorted({e.value for e in found})}")
    cls = found[0].load()
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {name!r} ({found[0].value}) is not a swarmrl.protocol.episodes.Environment")
    return cls


def load_environment(spec: EnvironmentSpec, check: bool = True) -> Environment:
    """The environment `spec` names, built with its validated options; with `check`, refused (ValueError saying
    why) unless it replays (`check_replay`)."""
    cls = environment_class(spec.name)
    try:
        options = cls.Options.model_validate(spec.options)
    except ValidationError as e:
        raise ValueError(f"[run.environment] {spec.name!r}: bad options: "
                         f"{describe_validation_error(e, root='options')}") from None
    env = cls(options)
    if check:
        check_replay(spec, env)
    return env


def _probe_replies(env: Environment) -> list[list[str | None]]:
    """The replies to every prefix of every probe transcript, twice over (the seeds 0 and 1)."""
    return [[env.reply(prompt, turns[:k], seed) for k in range(1, len(turns) + 1)]
            for prompt, turns in env.probes for seed in (0, 1)]


_REPLAYED: set[str] = set()


def check_replay(spec: EnvironmentSpec, env: Environment) -> None:
    """Refuse (ValueError) an environment whose replies to its probes differ between two calls here or between this
    process and another with another hash seed: the verifier could not replay what a node's environment said."""
    key = spec.model_dump_json()
    if f"{type(env).__module__}:{type(env).__qualname__}/{key}" in _REPLAYED:
        return
    here = _probe_replies(env)
    if here != _probe_replies(env):
        raise ValueError(f"[run.environment] {spec.name!r} answers the same turns differently twice in one process: "
                         "it reads a clock or a random source of its own, so nobody could replay an episode")
    hash_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    where = f"{type(env).__module__}:{type(env).__qualname__}"
    proc = subprocess.run([sys.executable, "-m", "swarmrl.protocol.episodes"], input=json.dumps([where, key]),
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONHASHSEED": hash_seed})
    if proc.returncode != 0:
        raise RuntimeError(f"the environment's replay check failed to run: {proc.stderr.strip()[-2000:]}")
    if json.loads(proc.stdout) != here:
        raise ValueError(f"[run.environment] {spec.name!r} answers the same turns differently in another process "
                         "(another hash seed): it depends on the order of a set or a dict of strings, or on the "
                         "process, so the verifier could not replay an episode")
    _REPLAYED.add(f"{type(env).__module__}:{type(env).__qualname__}/{key}")


# -- the shape of an episode -------------------------------------------------------------------------------------

def spans(turns: Sequence[int], n_tokens: int) -> list[tuple[int, int, bool]]:
    """(start, end, is_model) of each turn of a completion of `n_tokens` whose turn lengths are `turns` (empty: one
    model turn over all of it). Assumes `turns_problem` found nothing."""
    if not turns:
        return [(0, n_tokens, True)]
    out, at = [], 0
    for k, n in enumerate(turns):
        out.append((at, at + n, k % 2 == 0))
        at += n
    return out


def model_spans(turns: Sequence[int], n_tokens: int) -> list[tuple[int, int]]:
    """(start, end) of each model turn, in order (model turn k is the k-th)."""
    return [(a, b) for a, b, is_model in spans(turns, n_tokens) if is_model]


def model_token_mask(turns: Sequence[int], n_tokens: int) -> list[bool]:
    """Per completion token: whether the model sampled it (True) or the environment wrote it (False)."""
    mask = [True] * n_tokens
    for a, b, is_model in spans(turns, n_tokens):
        if not is_model:
            mask[a:b] = [False] * (b - a)
    return mask


def turns_problem(turns: Sequence[int], n_tokens: int, max_turns: int, max_tokens: int) -> str | None:
    """Why `turns` cannot describe a completion of `n_tokens` under a run of `max_turns` model turns of at most
    `max_tokens` tokens each, or None."""
    if not turns:
        return None if n_tokens <= max_tokens else f"{n_tokens} tokens exceed max_tokens {max_tokens}"
    if max_turns < 2:
        return "turns given, but this run's episodes have one model turn"
    if len(turns) % 2 == 0 or len(turns) < 3:
        return f"{len(turns)} turn lengths: an episode alternates model and environment turns, model first and last"
    if (len(turns) + 1) // 2 > max_turns:
        return f"{(len(turns) + 1) // 2} model turns exceed max_turns {max_turns}"
    if min(turns) < 1:
        return "a turn of no tokens"
    if sum(turns) != n_tokens:
        return f"turn lengths sum to {sum(turns)}, the completion has {n_tokens} tokens"
    if (longest := max(turns[0::2])) > max_tokens:
        return f"a model turn of {longest} tokens exceeds max_tokens {max_tokens}"
    return None


def _replay_probes() -> None:
    """`python -m swarmrl.protocol.episodes`: the probe replies of the environment (its class as 'module:name', its
    spec) read from stdin (JSON)."""
    import importlib

    where, key = json.loads(sys.stdin.read())
    module, name = where.split(":")
    cls = getattr(importlib.import_module(module), name)
    options = cls.Options.model_validate(EnvironmentSpec.model_validate_json(key).options)
    print(json.dumps(_probe_replies(cls(options))))


if __name__ == "__main__":
    _replay_probes()
