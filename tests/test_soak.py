"""A pool from docker/setup_pool.py's configs keeps training well past its nodes' warm-up, through a coordinator
SIGKILL and restart, a verifier restart and a trainer restart (issue 31's stall came 20 s after the nodes left
their warm-up: held groups filled the buffer and no lease went out again).

The bound: after every fault, and between any two steps, a training step comes within BOUND_S. A step takes
seconds here; a restart of the trainer (torch import, its state) well under a minute on a busy 2-core machine. The
old rule stalled for good, so any bound catches it; this one leaves room for a slow machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmrl.testing.soak import SoakPool

BOUND_S = 240.0
WARMUP_CHECKS = 4


@pytest.mark.slow(minutes=7)
def test_a_pool_keeps_training_past_warmup_and_through_restarts(tmp_path: Path) -> None:
    pool = SoakPool(tmp_path / "pool", warmup_checks=WARMUP_CHECKS).start()
    try:
        pool.wait_steps(2, BOUND_S)
        while min(pool.nodes_checks_passed() or [0]) < WARMUP_CHECKS:  # both nodes past the warm-up
            pool.wait_steps(1, BOUND_S)
        pool.wait_steps(3, BOUND_S)  # well past it: their groups are held now, and released by drawn checks
        for role in ("coordinator", "verifier", "trainer"):
            pool.fault(role)
            pool.wait_steps(2, BOUND_S)
        t = pool.training()
        assert t is not None and not t.stalled, t
    finally:
        pool.stop()
    timeline = pool.timeline
    assert timeline.held_seen > 0, "no group was ever held: the nodes never left their warm-up"
    assert [f for _, f in timeline.faults] == ["coordinator", "verifier", "trainer"]
    assert max(timeline.gaps()) <= BOUND_S, timeline.gaps()
