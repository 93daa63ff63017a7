"""Leasing stops while enough usable work is in flight, and resumes as the trainer takes groups; nothing the
pool holds for its own reasons (held groups, groups in the trainer's hands) withholds the leases that would move it.

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
    assert node.lease(max_prompts=1, held_version=0) is None  # 6 waiting for a verdict
    _verify_all(run)
    assert node.lease(max_prompts=1, held_version=0) is None  # 6 accepted, not yet handed to the trainer
    # The trainer takes three of them: those are in its hands, no longer holding the nodes' room.
    batch = run.op.training_batch(after_id=0, limit=3)
    assert len(batch.groups) == 3
    assert node.lease(max_prompts=1, held_version=0) is not None  # 3 waiting + 1 leased = 4: full again
    assert node.lease(max_prompts=1, held_version=0) is None
    assert run.op.training_batch(after_id=batch.groups[-1].group_id, limit=100).groups != []
    assert node.lease(max_prompts=1, held_version=0) is not None


def test_a_trainer_filling_a_batch_larger_than_the_buffer_is_not_starved(run_factory):
    """The stall of issue 31, second half: a trainer that needs more groups than the buffer leaves room for (it
    acknowledges only after a step) holds what it has read; reading must free that room or nothing is leased."""
    run: Run = run_factory(max_buffered_groups=4, max_staleness=1, admission=PROVEN)
    run.publish(0)
    node = run.node()
    cursor, taken = 0, 0
    while taken < 12:  # a batch of 12 through a buffer of 4, with no acknowledgement in between
        lease = node.lease(max_prompts=4, held_version=0)
        assert lease is not None, f"no lease with {taken} of 12 groups in the trainer's hands"
        node.submit(submission(lease))
        _verify_all(run)
        batch = run.op.training_batch(after_id=cursor, limit=100)
        taken += len(batch.groups)
        cursor = batch.groups[-1].group_id
    assert run.op.ack(cursor).acked == cursor


def test_held_groups_do_not_withhold_the_leases_that_release_them(run_factory):
    """The stall of issue 31, first half: held groups wait for a later drawn check of their node, which needs a
    submission, which needs a lease. Counted in the buffer, they stopped every lease for good."""
    from swarmrl.protocol import messages as m

    run: Run = run_factory(max_buffered_groups=4, max_staleness=1, admission=PROVEN)
    run.publish(0)
    node = run.node()
    held: list[int] = []
    while len(held) < 8:  # twice the buffer, every group held (passed the cheap checks, not drawn)
        lease = node.lease(max_prompts=4, held_version=0)
        assert lease is not None, f"no lease with {len(held)} groups held"
        node.submit(submission(lease))
        pending = run.op.pending(100)
        run.op.verdicts([m.Verdict(group_id=g.group_id, accepted=True, checked=False,
                                   rewards=[0.0] * len(g.group.rollouts)) for g in pending])
        held += [g.group_id for g in pending]
    assert run.op.training_batch(after_id=0, limit=100).groups == []  # nothing released yet
    lease = node.lease(max_prompts=1, held_version=0)
    assert lease is not None
    node.submit(submission(lease))
    [drawn] = run.op.pending(100)
    run.op.verdicts([m.Verdict(group_id=drawn.group_id, accepted=True, rewards=[0.0] * len(drawn.group.rollouts))])
    released = [g.group_id for g in run.op.training_batch(after_id=0, limit=100).groups]
    assert len(released) == len(held) + 1  # every held group, then the drawn one


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
