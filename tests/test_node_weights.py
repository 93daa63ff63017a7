"""Which weights a node generates a lease with: never a version newer than the lease's (the verifier bans
that), and not one too stale for it when a recent-enough one is on its way."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from swarmrl.node.agent import Node
from swarmrl.node.config import NodeConfig
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity


def _node(tmp_path: Path, held: int, ready: int) -> tuple[Node, list[Path]]:
    node = Node(NodeConfig(key_path=tmp_path / "node.key", work_dir=tmp_path / "data", progress=False))
    loaded: list[Path] = []
    node.engine = SimpleNamespace(temperature=1.0, load=loaded.append, close=lambda: None)  # type: ignore[assignment]
    node.stats.held_version = held
    node.weights.offer(ready, tmp_path / f"v{ready}")
    return node, loaded


def _lease(version: int) -> m.Lease:
    return m.Lease.issue(Identity.generate(), "pool", lease_id="l", node_id="n", policy_version=version,
                         expires_at=time.time() + 30, sampling=m.SamplingSpec(), prompts=[])


def test_catch_up_loads_recent_enough_weights(tmp_path: Path) -> None:
    node, loaded = _node(tmp_path, held=10, ready=13)
    node.wait_for_weights(_lease(14), max_staleness=2, temperature=1.0)
    assert node.stats.held_version == 13 and loaded == [tmp_path / "v13"] and node.weights.ready is None


def test_catch_up_never_loads_weights_newer_than_the_lease(tmp_path: Path) -> None:
    node, loaded = _node(tmp_path, held=10, ready=16)
    t0 = time.monotonic()
    node.wait_for_weights(_lease(14), max_staleness=2, temperature=1.0)
    assert time.monotonic() - t0 < 10  # gave up at once instead of waiting out the lease
    assert node.stats.held_version == 10 and loaded == []
    assert node.weights.ready == (16, tmp_path / "v16")  # kept for the next lease
    node.load_ready_weights(1.0)  # between leases the newest weights are loaded as before
    assert node.stats.held_version == 16 and loaded == [tmp_path / "v16"]
