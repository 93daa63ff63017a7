"""`verifiers_tools`: a verifiers (0.4) Toolset's `@vf.tool` methods as the environment of a multi-turn run.

    [run.environment]
    name = "verifiers_tools"
    [run.environment.options]
    toolset = "package.module:MyToolset"    # a vf.Toolset subclass
    config = { }                            # its config's fields

The model calls a tool by writing, in its turn, `<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>` (the
Hermes format Qwen's chat templates teach; the `verifiers` task's `toolset` option says so in the prompt). The
environment's reply is the tool's result (text as is, anything else as JSON with sorted keys) or an error message. A
turn without a tool call ends the episode: it is the answer the task scores. Of several calls in one turn, the last
is answered.

Where verifiers serves a toolset over MCP (a server process per rollout, state synced over an HTTP channel), here its
methods are called in-process, and its state is rebuilt from the transcript: every reply starts from a fresh
toolset and a fresh state, replays the tool calls of the model's earlier turns, then answers the last one. So the
reply is a function of the transcript whenever each tool is a function of its arguments and that state, which
`protocol.episodes.check_replay` checks on the probes (the options' `probes`, and one call of each tool with no
arguments) here and in another process.

Refused when it loads, with a one-line reason naming the option: a class that is no Toolset (a verifiers Env, whose
async run() owns the rollout; a Harness; a Judge), a toolset that is served elsewhere (`url`) or in a sandbox runtime
(docker, prime, ...), and one that overrides `setup` or `setup_task` (state made from the world or the task's row,
which the environment does not receive). A tool that reaches the network, and answers the same in both probe runs,
is not detected: docs/verifiers.md.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, validate_call

from swarmrl.protocol.episodes import Environment
from swarmrl.protocol.pydantic_errors import describe_validation_error
from swarmrl.tasks.verifierscommon import VerifiersRefused, load_toolset, run_coroutine, tool_names

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
MAX_ARGUMENTS_CHARS = 2048
"""A tool call whose JSON is longer is answered with an error, unparsed."""


class VerifiersToolsOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    toolset: str = Field(min_length=3, description="'package.module:Class' naming a vf.Toolset subclass.")
    config: dict[str, Any] = Field(default_factory=dict, description="The toolset's config fields.")
    probes: list[tuple[str, list[str]]] = Field(
        default_factory=list, description="More (prompt, model turns) transcripts the replay check runs: give "
        "ones that reach the tools' code paths.")


def tool_call(turn: str) -> tuple[str, dict[str, Any]] | str | None:
    """The last tool call in `turn` as (name, arguments); an error message for a malformed one; None for none."""
    calls = _CALL.findall(turn)
    if not calls:
        return None
    text = calls[-1]
    if len(text) > MAX_ARGUMENTS_CHARS:
        return f"error: a tool call longer than {MAX_ARGUMENTS_CHARS} characters"
    try:
        call = json.loads(text)
    except ValueError:
        return 'error: a tool call is {"name": ..., "arguments": {...}} in JSON'
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)
            and isinstance(call.get("arguments", {}), dict)):
        return 'error: a tool call is {"name": ..., "arguments": {...}} in JSON'
    return call["name"], call.get("arguments", {})


def as_text(result: Any) -> str:
    """A tool's result as the environment's reply: text as is, anything else as JSON with sorted keys (so that no
    dict order reaches the transcript)."""
    if isinstance(result, str):
        return result
    if isinstance(result, BaseModel):
        result = result.model_dump(mode="json")
    try:
        return json.dumps(result, sort_keys=True, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(result)


class VerifiersTools(Environment):
    """Answers the model's tool calls with a verifiers Toolset's methods (module docstring)."""

    name = "verifiers_tools"
    Options = VerifiersToolsOptions
    options: VerifiersToolsOptions

    def __init__(self, options: VerifiersToolsOptions):
        super().__init__(options)
        toolset = load_toolset(options.toolset, options.config, "[run.environment.options]")
        from verifiers.v1.mcp import server

        if not hasattr(server, "_call_state"):  # what `_replay` holds the state in (see there)
            raise VerifiersRefused("[run.environment.options] toolset: this verifiers version keeps a tool's state "
                                   "where the environment cannot set it (tested with verifiers 0.4.0)")
        self._cls, self._config = type(toolset), toolset.config
        self.probes = (*((p, tuple(t)) for p, t in options.probes),
                       ("Use a tool.", tuple(f'<tool_call>{{"name": "{n}", "arguments": {{}}}}</tool_call>'
                                             for n in sorted(tool_names(toolset)))),
                       ("Use a tool.", ("<tool_call>not json</tool_call>", "done")))

    def respond(self, prompt: str, turns: Sequence[str], seed: int) -> str | None:
        if tool_call(turns[-1]) is None:
            return None
        return run_coroutine(self._replay(turns))

    async def _replay(self, turns: Sequence[str]) -> str:
        """The answer to the last turn's tool call, after the earlier turns' calls on a fresh toolset and state."""
        from verifiers.v1.mcp import server

        toolset = self._cls(self._config)
        names = tool_names(toolset)
        # verifiers' own per-call state slot (a context variable its `state` property reads), so that the tools see
        # one state across the replayed calls, as they would over the state channel within one rollout.
        token = server._call_state.set(toolset._state_cls())
        try:
            answer = "error: no tool call"
            for turn in turns:
                call = tool_call(turn)
                if call is not None:
                    answer = await self._call(toolset, names, call)
            return answer
        finally:
            server._call_state.reset(token)

    @staticmethod
    async def _call(toolset: Any, names: dict[str, str], call: tuple[str, dict[str, Any]] | str) -> str:
        if isinstance(call, str):
            return call
        name, arguments = call
        if name not in names:
            return f"error: no tool {name!r}; tools: {sorted(names)}"
        try:
            result = validate_call(getattr(toolset, names[name]))(**arguments)
            if inspect.isawaitable(result):
                result = await result
        except ValidationError as e:
            return f"error: bad arguments for {name}: {describe_validation_error(e, limit=4, root='arguments')}"
        except Exception as e:  # (a tool's error on the model's arguments is an answer, as MCP would send it)
            with contextlib.suppress(Exception):
                return f"error: {type(e).__name__}: {e}"
            return "error"
        return as_text(result)
