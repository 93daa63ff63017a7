"""Each group carries its node's own signature (`protocol.groupsig`): the coordinator refuses a forged one at the door
(`bad_group_signature`), and the verifier and the trainer check it themselves, so a group rewritten in the
coordinator's store is refused without a ban and never trained on. Real coordinator on loopback (SQLite, and
PostgreSQL where the server is there), real clients, real Ed25519; the store rewritten through its own database."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from sqlalchemy import create_engine, select, update

from swarmrl.coordinator.db.schema import rollout_groups
from swarmrl.protocol import messages as m
from swarmrl.protocol.groupsig import sign_group, verify_group
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.refusals import RefusalCode
from swarmrl.protocol.signing import SignatureError
from swarmrl.trainer.collect import forged
from swarmrl.verifier.service import node_signature_problem
from tests.support.coordinator import submission

POOL = "test-run/" + "ab" * 32


def _group(logprob: float = -0.1 - 1e-17) -> m.RolloutGroup:
    rollouts = [m.Rollout(seed=s, completion_ids=[5, 6, 7], logprobs=[logprob, -2.5e-7, -3.0], finish_reason="stop",
                          claimed_reward=0.1 * s) for s in (1, 2)]
    return m.RolloutGroup(prompt_id="p1", prompt_ids=[1, 2, 3], rollouts=rollouts)


def test_a_group_verifies_only_as_its_node_signed_it():
    node, other = Identity.generate(), Identity.generate()
    facts = dict(lease_id="L1", policy_version=4, pool=POOL)
    signed = sign_group(node, _group(), **facts)
    assert sign_group(node, _group(), **facts) == signed  # signed once for good: the same signature again
    # As any receiver reads it: parsed from the JSON it travels as.
    received = m.RolloutGroup.model_validate_json(signed.model_dump_json())
    who = dict(node_key=node.public_key_hex, node_id=node.node_id)
    verify_group(received, **who, **facts)
    # A field at its default is not signed: a group that leaves it out (an older signer's) verifies the same.
    wire = json.loads(signed.model_dump_json())
    for r in wire["rollouts"]:
        r.pop("proof")
    verify_group(m.RolloutGroup.model_validate(wire), **who, **facts)
    rollout = received.rollouts[0]
    changed = {
        "a token": received.model_copy(update={"rollouts": [rollout.model_copy(update={"completion_ids": [5, 6, 8]}),
                                                            received.rollouts[1]]}),
        "a logprob": received.model_copy(update={"rollouts": [rollout.model_copy(update={"logprobs": [-0.2, -2.5e-7,
                                                                                                     -3.0]}),
                                                              received.rollouts[1]]}),
        "a logprob's last bit": received.model_copy(update={"rollouts": [rollout.model_copy(update={"logprobs": [
            math.nextafter(rollout.logprobs[0], 0.0), *rollout.logprobs[1:]]}), received.rollouts[1]]}),
        "the rollouts' order": received.model_copy(update={"rollouts": received.rollouts[::-1]}),
        "unsigned": received.model_copy(update={"node_signature": None}),
        "another's signature": sign_group(other, _group(), **facts),
    }
    for name, group in changed.items():
        with pytest.raises(SignatureError):
            verify_group(group, **who, **facts)
            pytest.fail(name)
    for name, update_ in {"another lease": {"lease_id": "L2"}, "another version": {"policy_version": 3},
                          "another pool": {"pool": POOL + "x"}}.items():
        with pytest.raises(SignatureError):
            verify_group(received, **who, **{**facts, **update_})
            pytest.fail(name)
    with pytest.raises(SignatureError, match="not node"):  # the key must be the named node's
        verify_group(sign_group(other, _group(), **facts), node_key=other.public_key_hex, node_id=node.node_id,
                     **facts)


def test_a_non_finite_claim_is_signed_as_it_travels():
    node = Identity.generate()
    group = _group()
    for claim in (float("nan"), float("inf")):
        group = group.model_copy(update={"rollouts": [group.rollouts[0].model_copy(update={"claimed_reward": claim}),
                                                      group.rollouts[1]]})
        signed = sign_group(node, group, lease_id="L", policy_version=0, pool=POOL)
        received = m.RolloutGroup.model_validate_json(signed.model_dump_json())
        assert received.rollouts[0].claimed_reward is None  # JSON carries it as null
        verify_group(received, node_key=node.public_key_hex, node_id=node.node_id, lease_id="L", policy_version=0,
                     pool=POOL)


def _rewrite(run, group_id: int) -> None:
    """Change a token of stored group `group_id` in the coordinator's database, its node signature kept."""
    engine = create_engine(run.cfg.store_url or f"sqlite:///{run.cfg.data_dir / 'coordinator.sqlite'}")
    try:
        with engine.begin() as con:
            g = rollout_groups.c
            doc = con.execute(select(g.payload).where(g.id == group_id)).scalar_one()
            doc = json.loads(doc) if isinstance(doc, str) else doc
            doc["rollouts"][0]["completion_ids"][0] += 1
            con.execute(update(rollout_groups).where(g.id == group_id).values(payload=doc))
    finally:
        engine.dispose()


@pytest.mark.both_stores
def test_honest_groups_verify_end_to_end_and_a_stored_forgery_is_refused(run_factory):
    run = run_factory()
    run.publish(0)
    node = run.node("honest")
    result = node.submit(submission(node.lease(2, 0)))
    assert len(result.accepted) == 2
    pending = run.op.pending(limit=10)
    assert [g.node_key for g in pending] == [node.identity.public_key_hex] * 2
    assert [node_signature_problem(g, run.pool) for g in pending] == [None, None]
    first, second = pending
    run.op.verdicts([m.Verdict(group_id=first.group_id, accepted=True, rewards=[1.0, 0.0, 0.5])])
    (fed,) = run.op.training_batch(after_id=0, limit=10).groups
    assert fed.node_key == node.identity.public_key_hex and forged(fed, run.pool) is None  # the trainer takes it

    # The store rewritten: the pending group, and the one in the trainer's feed.
    _rewrite(run, second.group_id)
    _rewrite(run, first.group_id)
    run.clock.advance(60)  # the claim on the pending group ends: claimed again, as rewritten
    (again,) = run.op.pending(limit=10)
    assert again.group_id == second.group_id
    assert "node signature does not verify" in (node_signature_problem(again, run.pool) or "")
    (fed,) = run.op.training_batch(after_id=0, limit=10).groups
    assert forged(fed, run.pool) is not None


def test_a_forged_node_signature_is_refused_at_the_door(run):
    node = run.node("forger")
    lease = node.lease(2, 0)
    sub = submission(lease)
    facts = dict(lease_id=lease.lease_id, policy_version=lease.policy_version, pool=run.pool)
    good = sign_group(node.identity, sub.groups[0], **facts)
    forgeries = {
        "another key's": sign_group(Identity.generate(), sub.groups[1], **facts),
        "for another lease": sign_group(node.identity, sub.groups[1], **{**facts, "lease_id": "other"}),
        "of other content": sign_group(node.identity, sub.groups[0], **facts).model_copy(
            update={"prompt_id": sub.groups[1].prompt_id}),
    }
    before = run.accepted_state()
    for name, bad in forgeries.items():
        body = sub.model_copy(update={"groups": [good, bad]}).model_dump_json().encode()
        resp = httpx.post(run.url + "/v1/submit", content=body,
                          headers=node.signature_header(m.KIND_SUBMIT, body))
        assert resp.status_code == 422 and resp.json()["code"] == RefusalCode.BAD_GROUP_SIGNATURE, (name, resp.text)
        assert sub.groups[1].prompt_id in resp.json()["detail"]
    assert run.accepted_state() == before  # nothing of it was taken
    assert node.submit(sub).accepted == [g.prompt_id for g in sub.groups]  # the client signs each group itself
