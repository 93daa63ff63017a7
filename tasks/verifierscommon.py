"""What the `verifiers` task and the `verifiers_tools` environment share: importing verifiers (0.4) when a run names
them, refusing what the swarm cannot use with a one-line reason, running verifiers' coroutines from synchronous code,
and a toolset's tools as the model sees them (their names, and the text that tells the model how to call them).

verifiers is not a dependency of this project (it moves openai and mcp to older versions): nothing here imports it
at module level.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
from collections.abc import Coroutine
from typing import Any, TypeVar

from swarmrl.runtime.errors import UserError

T = TypeVar("T")
CALL_FORMAT = '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'
"""How a model turn calls a tool (the Hermes format Qwen's chat templates teach)."""


class VerifiersRefused(UserError, ValueError):
    """A verifiers taskset, toolset or option that cannot be used in a swarm, said in one line with its option."""


def import_verifiers() -> Any:
    """`verifiers.v1`, or a VerifiersRefused saying how to install it."""
    try:
        return importlib.import_module("verifiers.v1")
    except ImportError as e:
        raise VerifiersRefused(f"the verifiers task and environments need the verifiers package (pip install "
                               f"verifiers==0.4.0 on every machine that loads them; it moves openai and mcp to "
                               f"older versions, see docs/verifiers.md): {e}") from None


def import_ref(ref: str, what: str, where: str = "[run.task.options]") -> Any:
    """The object `package.module:Name` names; VerifiersRefused naming the option `what` if there is none."""
    module, _, name = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise VerifiersRefused(f"{where} {what}: cannot import {ref!r}: {e!r}") from None
    return obj


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """`coro` run to its end from synchronous code: on a private event loop, in a worker thread when this thread
    already runs one (an async server's handler)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def refusal_for_class(cls: Any) -> str:
    """Why a verifiers class that is not what an option wants cannot be used instead ('' for anything else)."""
    vf = import_verifiers()
    if isinstance(cls, type) and issubclass(cls, vf.Env):
        return (": a verifiers Env owns its rollout (its async run() drives the agents and relays their turns, "
                "user-sim's user is another model), so no turn of it is a function the swarm could replay")
    if isinstance(cls, type) and issubclass(cls, vf.Harness):
        return ": a verifiers Harness is the agent's program, run in a sandbox; in the swarm the node is the agent"
    if isinstance(cls, type) and issubclass(cls, vf.Judge):
        return ": a verifiers Judge asks a model over the network, so its verdict can be neither replayed nor trusted"
    return ""




def tool_names(toolset: Any) -> dict[str, str]:
    """{name the model may call: method name} of a Toolset instance's `@vf.tool` methods: each tool's name, and that
    name after the server's prefix (how verifiers advertises it over MCP)."""
    from verifiers.v1.utils.decorators import discover_decorated

    out: dict[str, str] = {}
    for fn in discover_decorated(toolset, "tool"):
        name = getattr(fn, "tool_name", None) or fn.__name__
        out[name] = fn.__name__
        if toolset.server_name:
            out[f"{toolset.server_name}_{name}"] = fn.__name__
    return out


def tool_preamble(toolset: Any) -> str:
    """The text that tells a model which tools a Toolset instance offers and how to call them: verifiers sends tools
    in the request's `tools` field, which the swarm's prompts do not have, so the task puts this in the prompt."""
    from verifiers.v1.utils.decorators import discover_decorated

    lines = [f"You can call tools. To call one, end your message with {CALL_FORMAT}; its result comes back as the "
             "next message. Answer without a tool call when you are done. Tools:"]
    for fn in discover_decorated(toolset, "tool"):
        name = getattr(fn, "tool_name", None) or fn.__name__
        params = ", ".join(f"{p.name}: {getattr(p.annotation, '__name__', p.annotation)}"
                           for p in inspect.signature(fn).parameters.values())
        doc = " ".join((fn.__doc__ or "").split())
        lines.append(f"- {name}({params}){': ' + doc if doc else ''}")
    return "\n".join(lines)


def load_toolset(ref: str, config: dict[str, Any], where: str) -> Any:
    """A Toolset instance of the class `ref` names ('package.module:Class') with `config`, refused (VerifiersRefused,
    naming the option under `where`, e.g. '[run.environment.options]') unless its answers can be a function of the
    transcript: not served elsewhere or in a sandbox, no state made by `setup` or `setup_task`."""
    vf = import_verifiers()
    cls = import_ref(ref, "toolset", where)
    if not (isinstance(cls, type) and issubclass(cls, vf.Toolset)):
        raise VerifiersRefused(f"{where} toolset: {ref!r} is not a verifiers Toolset{refusal_for_class(cls)}")
    overridden = [h for h in ("setup", "setup_task") if getattr(cls, h) is not getattr(vf.Toolset, h)]
    if overridden:
        raise VerifiersRefused(f"{where} toolset: {cls.__name__} overrides {overridden}: its state starts from the "
                               "world or the task's row, not from the transcript, so the verifier could not replay "
                               "its answers")
    try:
        validated = cls._config_cls().model_validate(config)
    except (ValueError, TypeError) as e:
        raise VerifiersRefused(f"{where} config: the toolset refuses it: {e}".replace("\n", " ")) from None
    if getattr(validated, "url", None):
        raise VerifiersRefused(f"{where} config: url: the toolset is served elsewhere, over the network, so nobody "
                               "could replay its answers")
    runtime = getattr(validated, "runtime", None)
    if runtime is not None and not isinstance(runtime, vf.SubprocessConfig):
        raise VerifiersRefused(f"{where} config: runtime {type(runtime).__name__}: the toolset runs in a sandbox "
                               "whose files and processes are state outside the transcript")
    toolset = cls(validated)
    if not tool_names(toolset):
        raise VerifiersRefused(f"{where} toolset: {cls.__name__} has no @vf.tool methods")
    return toolset
