"""A node asks for leases its engine can generate in time: what fits a third of a lease's time to live, measured on
its own leases, between 1 and max_prompts (node/leasesize.py), in every way it asks (a lease request, the next lease
asked for with a submission, a lease asked for ahead).

The engine's cost is a fake clock the fake engine advances (the node reads generation time from it), so the sizes
do not depend on how busy the machine is."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from swarmrl.node import work as work_module
from swarmrl.node.engine import Completion, GenerationRequest
from swarmrl.node.leasesize import SHARE, LeaseSizer
from swarmrl.node.stats import NodeStats
from swarmrl.node.work import Work, WorkConfig
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.messages import Lease, LeasedPrompt, RolloutSubmission, SamplingSpec, SubmitResult

COORDINATOR = Identity.generate()
TTL_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Engine:
    """Generates one token per request; each request costs `seconds_per_request` on the fake clock."""

    def __init__(self, clock: Clock, seconds_per_request: float):
        self.clock, self.seconds_per_request = clock, seconds_per_request

    def generate(self, requests: list[GenerationRequest], max_tokens: int) -> list[Completion]:
        self.clock.now += self.seconds_per_request * len(requests)
        return [Completion(token_ids=[5], logprobs=[-0.1], finish_reason="length") for _ in requests]


class Client:
    """Grants a lease of exactly the prompts asked for (time to live TTL_S), by `lease` and with each submission
    that asks; records every size asked."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.granted = 0

    def _grant(self, n: int) -> Lease:
        self.asked.append(n)
        self.granted += 1
        return Lease.issue(COORDINATOR, "pool", lease_id=f"L{self.granted}", node_id="n", policy_version=0,
                           expires_at=time.time() + TTL_S, sampling=SamplingSpec(max_tokens=1, group_size=2),
                           prompts=[LeasedPrompt(prompt_id=f"p{self.granted}-{i}", text="hi", seeds=[1, 2])
                                    for i in range(n)])

    def lease(self, max_prompts: int, held_version: int) -> Lease | None:
        return self._grant(max_prompts)

    def submit(self, submission: RolloutSubmission) -> SubmitResult:
        ask = submission.next_lease
        return SubmitResult(accepted=[g.prompt_id for g in submission.groups], rejected={},
                            next_lease=None if ask is None else self._grant(ask.max_prompts))


def _run(monkeypatch: pytest.MonkeyPatch, seconds_per_prompt: float, leases: int, max_prompts: int = 8,
         pipeline: bool = False) -> list[int]:
    """The sizes a node asked for over `leases` leases whose engine spends `seconds_per_prompt` on each prompt."""
    clock = Clock()
    monkeypatch.setattr(work_module, "time", SimpleNamespace(perf_counter=clock.perf_counter, time=time.time,
                                                             monotonic=time.monotonic))
    client = Client()
    work = Work(WorkConfig(max_prompts=max_prompts, max_leases=leases, pipeline=pipeline), client,
                NodeStats(held_version=0), threading.Event())
    engine = Engine(clock, seconds_per_prompt / 2)  # two rollouts a prompt
    tokenizer = SimpleNamespace(apply_chat_template=None)
    monkeypatch.setattr(work_module, "render_prompt", lambda _tok, text: [1, 2, 3])
    lease = work.ask()
    while lease is not None:
        work.stats.leases += 1
        work.hand_over(work.generate(lease, engine, tokenizer))  # type: ignore[arg-type]
        work.prefetch()
        lease = work.lease_ready()
    work.close()
    return client.asked


def test_a_slow_node_asks_for_what_it_generates_in_a_third_of_a_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _run(monkeypatch, seconds_per_prompt=3.9, leases=4)
    # Nothing measured: max_prompts. Then 3.9 s a prompt against (almost) 60 s x 1/3 = 20 s: 5 prompts.
    assert asked[0] == 8
    assert asked[1:] == [int(SHARE * TTL_S / 3.9)] * (len(asked) - 1) == [5] * (len(asked) - 1)


def test_a_very_slow_node_asks_for_one_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _run(monkeypatch, seconds_per_prompt=45.0, leases=3)
    assert asked[0] == 8 and asked[1:] == [1] * (len(asked) - 1)


def test_a_fast_node_asks_for_max_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(_run(monkeypatch, seconds_per_prompt=0.05, leases=4, max_prompts=16)) == {16}


def test_the_pipelined_node_sizes_the_leases_it_asks_for_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _run(monkeypatch, seconds_per_prompt=9.5, leases=5, pipeline=True)
    assert asked[0] == 8 and len(asked) >= 3
    assert asked[-1] == 2  # 20 s / 9.5 s a prompt


def test_the_average_follows_a_change_of_speed() -> None:
    sizer = LeaseSizer(max_prompts=32)
    sizer.saw_lease(TTL_S + 0.01)  # a fraction over 20 s to spend
    sizer.observe(prompts=4, seconds=4.0)  # 1 s a prompt: 20
    assert sizer.ask() == 20
    for _ in range(10):  # the engine slows to 4 s a prompt (a bigger version, a busy machine)
        sizer.observe(prompts=4, seconds=16.0)
    assert sizer.ask() == 5
    sizer.observe(prompts=0, seconds=3.0)  # nothing generated: nothing learnt
    sizer.observe(prompts=3, seconds=0.0)
    assert sizer.ask() == 5
