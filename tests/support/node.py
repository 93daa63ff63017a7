"""A real node for tests: run in a thread (`NodeThread`), with settings fit for a tiny model on loopback
(`node_config`)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from swarmrl.node.agent import Node
from swarmrl.node.config import NodeConfig


class NodeThread:
    """A real Node running in a thread; `error` is what `run()` raised, if anything."""

    def __init__(self, cfg: NodeConfig):
        self.node = Node(cfg)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="node", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.node.run()
        except BaseException as e:  # surfaced by the test
            self.error = e

    def stop(self) -> None:
        self.node.stop()
        self.thread.join(60)
        assert not self.thread.is_alive()

    def accepted_at_least(self, n: int) -> bool:
        if self.error is not None:
            raise AssertionError(f"the node stopped: {self.error!r}")
        return self.node.stats.groups_accepted >= n


def node_config(tmp: Path, **over: Any) -> NodeConfig:
    settings: dict[str, Any] = dict(
        key_path=tmp / "node.key", work_dir=tmp / "node", name="stayer", progress=False, max_prompts=2,
        poll_interval_s=0.05, heartbeat_interval_s=0.5, max_backoff_s=1.0, request_timeout_s=20.0,
        engine={"kind": "torch", "num_threads": 1}, p2p={"enabled": False})
    settings.update(over)
    return NodeConfig(**settings)
