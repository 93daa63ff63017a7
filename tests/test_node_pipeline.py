"""A pipelined node keeps its engine busy: the next lease is generated while the last submission is on the wire,
a lease is asked for ahead so that one is in hand when generation ends, an identity held to one lease at a time
works one at a time without asking again and again, a refusal of the node itself still reaches its membership, and
stopping waits for the submission in flight.

A real `Node` (its `step`, `Work` and `_run` loop) with a fake client (the calls of `WorkClient` and the heartbeat)
and a fake engine; the threads are synchronised with events only (a wait's timeout is a deadlock guard whose
expiry fails the test, never a measurement)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from swarmrl.node.agent import Node
from swarmrl.node.config import NodeConfig
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.messages import Lease, LeasedPrompt, RolloutSubmission, SamplingSpec, SubmitResult
from swarmrl.protocol.overview import Training
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.runtime.client import CoordinatorError

GUARD_S = 30.0  # a deadlock guard: never reached when the code under test is right
COORDINATOR = Identity.generate()


def _lease(n: int) -> Lease:
    return Lease.issue(COORDINATOR, "pool", lease_id=f"L{n}", node_id="n", policy_version=0,
                       expires_at=time.time() + 600, sampling=SamplingSpec(max_tokens=4, group_size=2),
                       prompts=[LeasedPrompt(prompt_id=f"p{n}", text="hi", seeds=[1, 2])])


class FakeClient:
    """Grants leases L1, L2, ... (`lease`, and with each submission that asks for one, unless `one_at_a_time`);
    `hold_submit(n)` makes the submission of lease n wait until `release[n]` is set."""

    def __init__(self, one_at_a_time: bool = False):
        self.one_at_a_time = one_at_a_time
        self.granted = 0
        self.lease_calls = 0
        self.submitted: list[str] = []
        self.hold: dict[str, threading.Event] = {}
        self.held_released: dict[str, bool] = {}
        self.refuse: dict[str, CoordinatorError] = {}
        self.lock = threading.Lock()

    def _grant(self) -> Lease:
        with self.lock:
            self.granted += 1
            return _lease(self.granted)

    def lease(self, max_prompts: int, held_version: int) -> Lease | None:
        self.lease_calls += 1
        if self.one_at_a_time and self.granted > len(self.submitted):  # one in flight already: refused
            raise CoordinatorError(429, "over this identity's allowance", code=RefusalCode.PROMPTS_IN_FLIGHT)
        return self._grant()

    def submit(self, submission: RolloutSubmission) -> SubmitResult:
        lid = submission.lease_id
        if lid in self.hold:
            self.held_released[lid] = self.hold[lid].wait(GUARD_S)
        if lid in self.refuse:
            raise self.refuse[lid]
        self.submitted.append(lid)
        nxt = self._grant() if submission.next_lease is not None else None
        return SubmitResult(accepted=[g.prompt_id for g in submission.groups], rejected={}, next_lease=nxt)

    def __copy__(self) -> FakeClient:  # the node's copy without retries (it asks ahead once) shares the counts
        return self

    def training(self) -> Training:
        raise NotImplementedError

    def heartbeat(self, *a: Any, **kw: Any) -> None:
        pass


class FakeEngineNode(Node):
    """A real Node whose generation is a callback (`on_generate(lease_id)`) instead of an engine."""

    def __init__(self, cfg: NodeConfig, client: FakeClient):
        super().__init__(cfg)
        self.client = client  # type: ignore[assignment]
        self._run_info = SimpleNamespace(spec=SimpleNamespace(  # type: ignore[assignment]
            sampling=SimpleNamespace(temperature=1.0), max_staleness=1, environment=None))
        self.engine = SimpleNamespace(temperature=1.0, close=lambda: None)  # type: ignore[assignment]
        self.stats.held_version = 0
        self.generated: list[str] = []
        self.on_generate: dict[str, threading.Event] = {}

    def generate(self, lease: Lease) -> RolloutSubmission:
        self.generated.append(lease.lease_id)
        if lease.lease_id in self.on_generate:
            self.on_generate[lease.lease_id].set()
        group = SimpleNamespace(prompt_id=lease.prompts[0].prompt_id, rollouts=[])  # what the counts read
        return RolloutSubmission.model_construct(lease_id=lease.lease_id, policy_version=0, groups=[group],
                                                 gen_seconds=0.0, next_lease=None)


def _no_fetching() -> threading.Thread:
    t = threading.Thread(target=lambda: None)
    t.start()
    return t


def _node(tmp_path: Path, client: FakeClient, **over: Any) -> FakeEngineNode:
    cfg = NodeConfig(**{"key_path": tmp_path / "node.key", "work_dir": tmp_path / "data", "progress": False,
                        "max_prompts": 1, "receipts_interval_s": 1e12, **over})
    return FakeEngineNode(cfg, client)


def test_the_next_lease_is_generated_while_the_last_submission_is_on_the_wire(tmp_path: Path) -> None:
    client = FakeClient()
    node = _node(tmp_path, client)
    generating_l2 = threading.Event()
    client.hold["L1"] = generating_l2  # L1's submission is answered only once L2 is being generated
    node.on_generate["L2"] = generating_l2
    for _ in range(3):
        assert node.step()
    node.work.close()
    assert client.held_released == {"L1": True}  # L2 was generated while L1's submission waited
    assert node.generated == ["L1", "L2", "L3"] and client.submitted == ["L1", "L2", "L3"]
    assert client.lease_calls == 2  # the first lease, and the one asked for ahead; the rest came with submissions
    assert node.stats.groups_accepted == 3 and node.stats.leases == 3


def test_unpipelined_the_engine_waits_for_the_submission(tmp_path: Path) -> None:
    """The same scenario, pipelining off: L1's submission is answered before L2 is generated (the guard of the test
    above is therefore what fails if the node did not pipeline)."""
    client = FakeClient()
    node = _node(tmp_path, client, pipeline=False)
    released = threading.Event()
    released.set()
    client.hold["L1"] = released
    node.on_generate["L2"] = threading.Event()
    assert node.step()
    assert client.submitted == ["L1"] and node.generated == ["L1"]  # answered within the step
    assert node.step() and client.submitted == ["L1", "L2"]
    assert client.lease_calls == 1


def test_an_identity_held_to_one_lease_works_one_at_a_time_without_asking_again(tmp_path: Path) -> None:
    client = FakeClient(one_at_a_time=True)
    node = _node(tmp_path, client)
    for _ in range(4):
        assert node.step()
    node.work.close()
    assert node.generated == ["L1", "L2", "L3", "L4"] and client.submitted == node.generated
    assert client.lease_calls == 2  # the first, and one refused ask ahead: then it pauses (PREFETCH_PAUSE_S)


def test_a_refusal_of_the_node_still_reaches_its_membership(tmp_path: Path) -> None:
    client = FakeClient()
    client.refuse["L1"] = CoordinatorError(403, "banned", code=RefusalCode.BANNED)
    node = _node(tmp_path, client)
    assert node.step()  # L1 handed over, L2 asked for ahead
    with pytest.raises(CoordinatorError) as e:  # raised in the node's thread, no later than its next submission
        node.step()
    assert e.value.code is RefusalCode.BANNED
    node.work.close()


def test_a_refusal_of_the_node_stops_the_running_node(tmp_path: Path) -> None:
    """Through `run`'s loop: the ban of the first submission, answered on the courier, stops the node with the
    membership's PermanentRefusal."""
    from swarmrl.node.refusal import PermanentRefusal

    client = FakeClient()
    client.refuse["L1"] = CoordinatorError(403, "banned", code=RefusalCode.BANNED)
    node = _node(tmp_path, client)
    node.join = lambda: None  # type: ignore[method-assign]
    node.weights.start = _no_fetching  # type: ignore[method-assign]
    with pytest.raises(PermanentRefusal):
        node._run()


def test_stop_waits_for_the_submission_in_flight(tmp_path: Path) -> None:
    """The loop ends at max_leases with L2's submission on the courier, answered only once the node is stopping:
    run() returns after it was answered and counted."""
    client = FakeClient()
    node = _node(tmp_path, client, max_leases=2)
    client.hold["L2"] = node._stop
    node.join = lambda: None  # type: ignore[method-assign]
    node.weights.start = _no_fetching  # type: ignore[method-assign]
    node._run()
    assert client.held_released == {"L2": True} and client.submitted == ["L1", "L2"]
    assert node.stats.groups_accepted == 2
    assert node.stats.leases == 2 and client.granted == 2  # no lease asked for beyond max_leases


def test_a_lease_that_comes_while_one_is_in_hand_is_kept(tmp_path: Path) -> None:
    """Settling the courier with a lease still in hand keeps the one the answer brought, after it (a dropped lease
    would count against the node's allowance until it expired)."""
    client = FakeClient()
    node = _node(tmp_path, client)
    assert node.step()  # L1 generated and handed over (asking for L3); L2 asked for ahead and in hand
    node.work.settle()  # L3 arrives while L2 is in hand
    assert node.step() and node.step()
    node.work.close()
    assert node.generated == ["L1", "L2", "L3"] and client.lease_calls == 2


def test_switching_pipelining_off_keeps_the_leases_in_hand(tmp_path: Path) -> None:
    """Two leases in hand when pipelining is turned off: each is worked on, none dropped for the one a submission
    brings."""
    import dataclasses

    client = FakeClient()
    node = _node(tmp_path, client)
    assert node.step()
    node.work.settle()  # L2 and L3 in hand
    node.work.cfg = dataclasses.replace(node.work.cfg, pipeline=False)
    assert node.step() and node.step() and node.step()
    assert node.generated == ["L1", "L2", "L3", "L4"] and client.submitted == node.generated
