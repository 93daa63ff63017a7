"""A submission that asks for its node's next lease (`RolloutSubmission.next_lease`) gets it in the same answer,
granted after the submission settled its lease, signed and checked like any lease; a grant that would be refused
leaves the submission's outcome whole; a retry gets the same lease; and a node's loop uses it (one round trip per
lease). Against a real coordinator on loopback, on SQLite and on PostgreSQL."""

from __future__ import annotations

import httpx
import pytest

from swarmrl.coordinator.admission import AdmissionConfig
from swarmrl.coordinator.leases import NO_WORK
from swarmrl.protocol import messages as m
from tests.support.coordinator import Run, signed, submission

pytestmark = pytest.mark.both_stores


def _asking(sub: m.RolloutSubmission, max_prompts: int = 2, held_version: int = 0) -> m.RolloutSubmission:
    return sub.model_copy(update={"next_lease": m.LeaseRequest(max_prompts=max_prompts, held_version=held_version)})


def test_a_submission_brings_back_the_next_lease(run: Run) -> None:
    node = run.node()
    first = node.lease(2, 0)
    result = node.submit(_asking(submission(first)))  # the client checks the lease's signature, node and sampling
    assert sorted(result.accepted) == sorted(p.prompt_id for p in first.prompts)
    nxt = result.next_lease
    assert nxt is not None and result.next_lease_refused == ""
    assert nxt.lease_id != first.lease_id and nxt.node_id == node.identity.node_id and len(nxt.prompts) == 2
    # It is a lease like any other: its groups are taken, and the chain goes on.
    again = node.submit(_asking(submission(nxt), max_prompts=1))
    assert sorted(again.accepted) == sorted(p.prompt_id for p in nxt.prompts)
    assert again.next_lease is not None and len(again.next_lease.prompts) == 1
    st = run.op.status()
    assert st.groups_pending == 4
    assert st.nodes[0].held_version == 0


def test_a_refused_grant_leaves_the_submission_whole(run_factory) -> None:
    # One prompt in flight per identity: after the first lease is submitted and a second one taken, a late
    # resubmission of the first asks for a lease it may not have (429 inside the grant).
    run = run_factory(admission=AdmissionConfig(new_identity_prompts=1))
    run.publish(0)
    node = run.node()
    first = node.lease(1, 0)
    assert node.submit(submission(first)).accepted
    second = node.lease(1, 0)
    assert second is not None
    late = node.submit(_asking(submission(first), max_prompts=1))
    assert late.accepted == [] and list(late.rejected.values()) == ["already submitted"]
    assert late.next_lease is None and "may hold 1 prompts in flight" in late.next_lease_refused
    # The refused grant changed nothing: the second lease is still the node's one lease in flight and is taken.
    assert node.submit(submission(second)).accepted == [second.prompts[0].prompt_id]
    assert run.op.status().groups_pending == 2


def test_no_work_is_said_as_such(run_factory) -> None:
    run = run_factory(max_buffered_groups=1)  # one group pending fills the buffer: backpressure
    run.publish(0)
    node = run.node()
    result = node.submit(_asking(submission(node.lease(1, 0)), max_prompts=1))
    assert result.accepted and result.next_lease is None and result.next_lease_refused == NO_WORK


def test_a_retry_gets_the_same_next_lease(run: Run) -> None:
    node = run.node()
    sub = _asking(submission(node.lease(1, 0)), max_prompts=1)
    body, headers = signed(node.identity, m.KIND_SUBMIT, run.pool, sub)
    key = {"Idempotency-Key": "retry-of-one-submission-0001"}
    first = httpx.post(run.url + "/v1/submit", content=body, headers={**headers, **key})
    body2, headers2 = signed(node.identity, m.KIND_SUBMIT, run.pool, sub)  # a fresh signature, as a retry has
    second = httpx.post(run.url + "/v1/submit", content=body2, headers={**headers2, **key})
    assert first.status_code == second.status_code == 200
    a, b = m.SubmitResult.model_validate_json(first.content), m.SubmitResult.model_validate_json(second.content)
    assert a.next_lease is not None and a == b
    st = run.op.status()
    assert st.groups_pending == 1 and st.nodes[0].prompts_leased == 2  # the first lease and one next lease
