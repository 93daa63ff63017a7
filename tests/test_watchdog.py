"""The watchdog names what keeps a pool from training, each blocker caused here by the situation it names, on a real
coordinator whose clock the test moves (never further than the signed requests' clock window)."""

from __future__ import annotations

import httpx

from swarmrl.protocol import messages as m
from swarmrl.protocol.overview import Blocker
from tests.support.coordinator import Run, submission

# Short windows so that moving the coordinator's clock by less than clock_skew_s (120 s) crosses them; no cache.
WATCH = {"stall_after_s": 60.0, "absent_after_s": 20.0, "cache_s": 0.0}
PROVEN = {"proven_after_groups": 0}


def _start(run_factory, **overrides) -> Run:
    return run_factory(watchdog=WATCH, node_gone_after_s=20.0, admission=PROVEN, **overrides)


def _blockers(run: Run) -> list[Blocker]:
    return run.op.training().blockers


def test_a_new_pool_waits_for_its_checkpoint_trainer_and_nodes(run_factory):
    run = _start(run_factory)
    t = run.op.training()
    assert t.blockers == [Blocker.NO_CHECKPOINT, Blocker.TRAINER_ABSENT, Blocker.NO_NODES]
    assert not t.stalled and t.last_step_at is None
    assert "no checkpoint" in t.why and "trainer" in t.why
    run.clock.advance(61)
    assert run.op.training().stalled  # nothing published within stall_after_s of the start


def test_a_healthy_pool_is_blocked_by_nothing(run_factory):
    run = _start(run_factory)
    run.publish(0)
    node = run.node()
    run.op.training_batch(after_id=0, limit=1)  # the trainer is there
    t = run.op.training()
    assert t.blockers == [] and t.why == "" and not t.stalled
    assert node.lease(max_prompts=1, held_version=0) is not None


def test_a_silent_trainer_is_absent_until_it_reads_again(run_factory):
    run = _start(run_factory)
    run.publish(0)
    run.op.training_batch(after_id=0, limit=1)
    run.clock.advance(21)
    node = run.node()  # heard from after the clock moved: live
    assert _blockers(run) == [Blocker.TRAINER_ABSENT]
    run.op.training_batch(after_id=0, limit=1)
    assert _blockers(run) == []
    node.heartbeat(0)


def test_gone_nodes_leave_no_node(run_factory):
    run = _start(run_factory)
    run.publish(0)
    run.node()
    run.clock.advance(21)
    run.op.training_batch(after_id=0, limit=1)
    assert _blockers(run) == [Blocker.NO_NODES]


def test_groups_nobody_claims_mean_no_verifier(run_factory):
    run = _start(run_factory)
    run.publish(0)
    run.op.training_batch(after_id=0, limit=1)
    node = run.node()
    node.submit(submission(node.lease(max_prompts=1, held_version=0)))
    assert _blockers(run) == [Blocker.NO_VERIFIER]  # no verifier ever claimed
    [claimed] = run.op.pending(10)
    assert _blockers(run) == []  # one is at work now
    run.clock.advance(21)
    node.heartbeat(0)
    run.op.training_batch(after_id=0, limit=1)
    assert _blockers(run) == [Blocker.NO_VERIFIER]  # its claim lapsed and nobody came back
    run.op.verdicts([m.Verdict(group_id=claimed.group_id, accepted=True, rewards=[0.0] * len(claimed.group.rollouts))])
    assert Blocker.NO_VERIFIER not in _blockers(run)  # nothing waits for a verdict any more


def test_a_full_buffer_is_named(run_factory):
    run = _start(run_factory, max_buffered_groups=2)
    run.publish(0)
    run.op.training_batch(after_id=0, limit=1)
    node = run.node()
    assert node.lease(max_prompts=2, held_version=0) is not None
    assert _blockers(run) == [Blocker.BUFFER_FULL]
    assert node.lease(max_prompts=1, held_version=0) is None


def test_a_stall_with_held_groups_names_them_and_the_metric_shows_it(run_factory):
    run = _start(run_factory)
    run.publish(0)
    node = run.node()
    node.submit(submission(node.lease(max_prompts=2, held_version=0)))
    pending = run.op.pending(10)
    run.op.verdicts([m.Verdict(group_id=g.group_id, accepted=True, checked=False,
                               rewards=[0.0] * len(g.group.rollouts)) for g in pending])
    run.op.training_batch(after_id=0, limit=1)
    assert _blockers(run) == [Blocker.HELD_AWAITING_CHECKS]  # shown even before the pool counts as stalled
    run.clock.advance(61)
    node.heartbeat(0)
    run.op.training_batch(after_id=0, limit=1)
    t = run.op.training()
    assert t.stalled and t.blockers == [Blocker.HELD_AWAITING_CHECKS] and t.since_last_step_s > 60
    shown = run.op.overview().training
    assert shown is not None and shown.stalled and shown.blockers == t.blockers
    text = httpx.get(run.url + "/metrics").text
    assert "swarmrl_coordinator_training_stalled 1.0" in text
    assert 'swarmrl_coordinator_training_blocked{blocker="held_awaiting_checks"} 1.0' in text
    assert 'swarmrl_coordinator_training_blocked{blocker="buffer_full"} 0.0' in text


def test_a_stall_with_nothing_blocked_is_waiting_for_groups_and_ends_with_a_version(run_factory):
    run = _start(run_factory)
    run.publish(0)
    node = run.node()
    run.clock.advance(61)
    node.heartbeat(0)
    run.op.training_batch(after_id=0, limit=1)
    t = run.op.training()
    assert t.stalled and t.blockers == [Blocker.WAITING_FOR_GROUPS]
    run.publish(1)
    t = run.op.training()
    assert not t.stalled and t.blockers == []


def test_a_node_without_work_says_why(run_factory):
    from swarmrl.node.stats import NO_WORK_ASK_EVERY_S, NodeStats

    run = _start(run_factory, max_buffered_groups=1)
    run.publish(0)
    run.op.training_batch(after_id=0, limit=1)
    assert run.node("hoarder").lease(max_prompts=1, held_version=0) is not None
    node = run.node()
    assert node.lease(max_prompts=1, held_version=0) is None
    stats = NodeStats()
    stats.ask_why_no_work(node, now=100.0)
    assert "buffer is full" in stats.no_work  # what its panel shows as "no work: ..."
    stats.no_work = "earlier answer"
    stats.ask_why_no_work(node, now=100.0 + NO_WORK_ASK_EVERY_S / 2)
    assert stats.no_work == "earlier answer"  # asked at most every NO_WORK_ASK_EVERY_S
    stats.count_lease()
    assert stats.no_work == "" and stats.leases == 1
