"""Leasing stops while enough usable work is in flight, and resumes as the trainer acknowledges groups.

These nodes count as proven from the start (`admission.proven_after_groups=0`): the buffer as a whole is what is
tested here; how unproven identities share it is tests/test_admission.py's."""

from __future__ import annotations

from tests.support.coordinator import Run, submission

PROVEN = {"proven_after_groups": 0}


def _verify_all(run: Run) -> None:
    from swarmrl.protocol import messages as m

    pending = run.op.pending(100)
    run.op.verdicts([m.Verdict(group_id=g.group_id, accepted=True, rewards=[0.0] * len(g.group.rollouts))
                     for g in pending])


def test_leasing_pauses_at_the_buffer_limit_and_resumes(run_factory):
    run: Run = run_factory(max_buffered_groups=4, max_staleness=1, admission=PROVEN)
    run.publish(0)
    node = run.node()
    first = node.lease(max_prompts=3, held_version=0)
    assert first is not None
    second = node.lease(max_prompts=3, held_version=0)  # 3 in flight < 4: still leased
    assert second is not None
    assert node.lease(max_prompts=1, held_version=0) is None  # 6 in flight: no more work for now
    # Submitting and verifying moves work along but it is still in flight until the trainer takes it.
    node.submit(submission(first))
    node.submit(submission(second))
    _verify_all(run)
    assert node.lease(max_prompts=1, held_version=0) is None
    batch = run.op.training_batch(after_id=0, limit=100)
    assert len(batch.groups) == 6
    # Reading the feed moves nothing: the groups are in flight until the trainer acknowledges them (after saving).
    assert run.op.training_batch(after_id=batch.groups[-1].group_id, limit=100).groups == []
    assert node.lease(max_prompts=1, held_version=0) is None
    assert run.op.ack(batch.groups[2].group_id).acked == 3  # half of them: 3 still in flight, under the limit
    assert node.lease(max_prompts=1, held_version=0) is not None


def test_stale_work_does_not_hold_the_buffer(run_factory):
    run: Run = run_factory(max_buffered_groups=2, max_staleness=0, admission=PROVEN)
    run.publish(0)
    node = run.node()
    lease = node.lease(max_prompts=2, held_version=0)
    assert node.lease(max_prompts=1, held_version=0) is None
    node.submit(submission(lease))
    run.publish(1)  # with k = 0, version-0 groups can no longer be used: they free the buffer
    assert node.lease(max_prompts=1, held_version=1) is not None


def test_a_stale_submission_frees_its_lease_slot(run_factory):
    from swarmrl.runtime.client import CoordinatorError

    run: Run = run_factory(max_outstanding_leases=1, max_staleness=0)
    run.publish(0)
    node = run.node()
    lease = node.lease(max_prompts=1, held_version=0)
    run.publish(1)
    try:
        node.submit(submission(lease))
        raise AssertionError("a stale submission must be refused")
    except CoordinatorError as e:
        assert e.status == 409 and "stale" in e.reason
    assert node.lease(max_prompts=1, held_version=1) is not None  # the slot was freed
