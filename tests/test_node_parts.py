"""The node is split along its life: membership, weights, work, each with a small client interface of its own,
composed by a small `node.agent`; and the node's config, followed from `swarmrl node`'s runner through a real run,
passes through each module once (nothing calls back into a module it left on the way down)."""

from __future__ import annotations

import ast
import inspect
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from pydantic import BaseModel

from swarmrl.node import membership, weights, work
from swarmrl.node.config import NodeConfig
from swarmrl.node.runner import run_node
from swarmrl.runtime.client import CoordinatorClient
from swarmrl.testing.byzantine.harness import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
PARTS = {membership: membership.MembershipClient, weights: weights.WeightsClient, work: work.WorkClient}


def _methods(protocol: type) -> set[str]:
    return {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}


def test_each_part_talks_through_a_small_client_interface_the_real_client_has() -> None:
    for part, client in PARTS.items():
        assert issubclass(client, Protocol) and client.__module__ == part.__name__  # type: ignore[arg-type]
        assert 1 <= len(_methods(client)) <= 5, (client.__name__, _methods(client))
        for name in _methods(client):  # the real client implements each call, taking the parameters it is given
            assert set(inspect.signature(getattr(client, name)).parameters) <= \
                set(inspect.signature(getattr(CoordinatorClient, name)).parameters), (client.__name__, name)


def _our_imports(module: Any) -> set[str]:
    tree = ast.parse(Path(module.__file__).read_text())
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
            and n.module.startswith("swarmrl.")}


def test_the_parts_import_neither_each_other_nor_what_composes_them() -> None:
    """cli -> node.runner -> node.agent -> membership / weights / work -> engines, transfer, runtime: one way."""
    above = {"swarmrl.node.agent", "swarmrl.node.runner", "swarmrl.cli"}
    for part in PARTS:
        siblings = {p.__name__ for p in PARTS} - {part.__name__}
        assert not _our_imports(part) & (above | siblings), part.__name__
    assert len((ROOT / "node" / "agent.py").read_text().splitlines()) <= 250  # a composition, not a hub


# -- the config's path through a real run --------------------------------------------------------------------------

CONFIG_MODULES = ("swarmrl.node.", "swarmrl.transfer.")


def _is_config(x: object) -> bool:
    """The node's config or a part of it: a settings model or dataclass named *Config of the node or transfer."""
    t = type(x)
    return t.__name__.endswith("Config") and t.__module__.startswith(CONFIG_MODULES) and (
        isinstance(x, BaseModel) or hasattr(t, "__dataclass_fields__"))


def _carries_config(frame: FrameType) -> bool:
    """Whether a call just made receives the config (or a part of it), or is a method of an object holding one."""
    code = frame.f_code
    for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
        x = frame.f_locals.get(name)
        if _is_config(x) or (name == "self" and any(_is_config(v) for v in getattr(x, "__dict__", {}).values())):
            return True
    return False


@dataclass
class CallPath:
    """Modules of ours entered by calls that carry the config, in the order first entered, and every call that
    entered a module already on the call stack below another one (A -> B -> A: a ping-pong)."""

    order: list[str] = field(default_factory=list)
    ping_pongs: set[tuple[str, ...]] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("swarmrl.") or not _carries_config(frame):
            return
        stack: list[str] = []  # the modules of ours below, innermost first, repeats collapsed
        f = frame.f_back
        while f is not None:
            name = f.f_globals.get("__name__", "")
            if name.startswith("swarmrl.") and (not stack or stack[-1] != name):
                stack.append(name)
            f = f.f_back
        with self.lock:
            if module not in self.order:
                self.order.append(module)
            if stack and stack[0] != module and module in stack:
                self.ping_pongs.add((*reversed(stack[:stack.index(module) + 1]), module))


@contextmanager
def traced() -> Iterator[CallPath]:
    path = CallPath()
    threading.setprofile(path.profile)
    sys.setprofile(path.profile)
    try:
        yield path
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def test_the_node_config_passes_through_each_module_once(run_factory, tmp_path: Path) -> None:
    """A real node (torch engine, a real coordinator on loopback) from `swarmrl node`'s runner to two leases
    submitted: no config-carrying call enters a module it left on the way down."""
    run = run_factory()
    run.publish_checkpoint(make_checkpoint(tmp_path / "ckpt"), 0, shard_size=60_000)
    cfg = NodeConfig(coordinator_url=run.url, key_path=tmp_path / "node.key", work_dir=tmp_path / "node-data",
                     name="traced", poll_interval_s=0.05, progress=False, max_leases=2, max_prompts=1,
                     heartbeat_interval_s=0.01, receipts_interval_s=0.01, engine={"kind": "torch", "proofs": False},
                     p2p={"enabled": False})
    sigterm = signal.getsignal(signal.SIGTERM)  # the runner stops the node on SIGTERM: put back what pytest had
    try:
        with traced() as path:
            stats = run_node(cfg)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert stats.leases == 2 and stats.groups_submitted == 2
    for module in ("swarmrl.node.runner", "swarmrl.node.agent", "swarmrl.node.membership", "swarmrl.node.weights",
                   "swarmrl.node.work"):
        assert module in path.order, (module, path.order)
    assert path.order.index("swarmrl.node.runner") < path.order.index("swarmrl.node.agent")
    assert not path.ping_pongs, sorted(path.ping_pongs)
