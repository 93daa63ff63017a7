"""A submission that asks for its node's next lease (`RolloutSubmission.next_lease`) gets it in the same answer,
granted after the submission settled its lease, signed and checked like any lease; a grant that would be refused
leaves the submission's outcome whole; a retry gets the same lease; and a node's loop uses it (one round trip per
lease). Against a real coordinator on loopback, on SQLite and on PostgreSQL."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import func, select

from swarmrl.coordinator.admission import AdmissionConfig
from swarmrl.coordinator.db.schema import in_flight, nodes
from swarmrl.coordinator.db.store import Store, Tx
from swarmrl.coordinator.leases import NO_WORK
from swarmrl.protocol import messages as m
from swarmrl.protocol.identity import Identity
from swarmrl.runtime.client import CoordinatorClient
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


def test_a_refused_grant_still_takes_back_what_the_submission_settled(run_factory) -> None:
    # Settling a lease and granting the next one move the same counter rows, in one pass at the end of the grant;
    # when the grant is refused (and rolled back), the settlement's moves must still be made.
    run = run_factory(admission=AdmissionConfig(new_identity_prompts=3, abandon_prior=1.0))
    run.publish(0)
    node = run.node()
    first, second = node.lease(2, 0), node.lease(1, 0)
    assert first is not None and second is not None
    # One of `first`'s two prompts left out: abandoned, the allowance falls to 1, and `second`'s prompt fills it.
    result = node.submit(_asking(submission(first, prompts=first.prompts[:1]), max_prompts=1))
    assert len(result.accepted) == 1 and "may hold 1 prompts in flight and holds 1" in result.next_lease_refused

    def counted(tx: Tx) -> tuple[int, int]:
        table = int(tx.execute(select(func.sum(in_flight.c.n)).where(in_flight.c.cls == "unproven")).scalar_one())
        own = int(tx.execute(select(nodes.c.in_flight)).scalar_one())
        return table, own

    store = Store(run.cfg.resolved_store_url)
    try:
        assert store.read(counted) == (1, 1)  # `second`'s prompt only
    finally:
        store.close()


@pytest.mark.parametrize("restart", [False, True], ids=["granted-here", "granted-before-a-restart"])
def test_groups_are_judged_alike_whether_the_process_knows_their_lease(run_factory, tmp_path, restart) -> None:
    # A coordinator checks a submission's groups before its transaction against the leases it granted itself
    # (`coordinator.compose.RecentLeases`); a lease it does not know (granted before a restart, or by another worker)
    # is checked in the transaction. Both give the same answer.
    op = Identity.generate()
    run = run_factory(data_dir=tmp_path / "coord", op_key=op)
    run.publish(0)
    node = run.node()
    lease = node.lease(3, 0)
    assert lease is not None
    if restart:
        run_factory.stop_last()
        run = run_factory(data_dir=tmp_path / "coord", op_key=op)
        node = CoordinatorClient(run.url, node.identity, retries=0, coordinator_key=run.key.public_key_hex)
    sub = submission(lease, prompts=lease.prompts[:2])
    sub.groups[1].rollouts[0].seed += 1  # not a seed the lease fixed
    result = node.submit(_asking(sub, max_prompts=1))
    good, bad, left_out = (p.prompt_id for p in lease.prompts)
    assert result.accepted == [good] and set(result.rejected) == {bad} and "seed" in result.rejected[bad]
    assert result.next_lease is not None and len(result.next_lease.prompts) == 1
    # What the submission left out, or got refused, is leased again to another identity (of another source: another
    # machine) before anything new.
    other = run.node("other", source="127.0.0.2")
    first = other.lease(1, 0)
    assert first is not None
    nxt = other.submit(_asking(submission(first), max_prompts=2)).next_lease
    assert nxt is not None
    abandoned = {p.text for p in lease.prompts if p.prompt_id in (bad, left_out)}
    assert {p.text for p in first.prompts} | {p.text for p in nxt.prompts} >= abandoned
