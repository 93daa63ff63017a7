"""The K / p policy and the coordinator's quarantine, end to end with real nodes, coordinator and verifier:
- after K passed checks, sampled-out groups are held, and reach the trainer only when a later check passes;
- a node that turns bad after K loses its held groups and its identity at the first failed check;
- only a check of a *later* group releases a held one; cheap checks still reject held-mode groups at once;
- each group is verified against the weights of its own policy version (within the staleness bound).
"""

from __future__ import annotations

import pytest

from swarmrl.protocol import messages as m
from swarmrl.runtime.client import CoordinatorError
from swarmrl.testing.byzantine import nodes as bad
from swarmrl.testing.byzantine.harness import make_checkpoint, open_pool, perturb_checkpoint

K = 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "v0")


@pytest.fixture
def pool(tmp_path, ckpt):
    with open_pool(tmp_path, ckpt, verifier={"warmup_checks": K, "sample_rate": 0.0, "policy_seed": 0}) as p:
        yield p


def feed(pool) -> list[m.TrainingGroup]:
    return pool.op.training_batch(after_id=0, limit=1000).groups


def rounds(pool, node, n: int) -> None:
    for _ in range(n):
        node.step()
        pool.verify_all()


class Sleeper(bad.EditNode):
    """Honest until `cheating` is set, then edits one token per group (re-annotated with the true model)."""

    cheating = False

    def tamper(self, submission, lease):
        return super().tamper(submission, lease) if self.cheating else submission


def test_sampled_out_groups_are_held_until_a_later_check_passes(pool):
    node = pool.node(max_prompts=1)
    rounds(pool, node, K)
    assert len(feed(pool)) == K and pool.verifier.stats.full_checks == K
    rounds(pool, node, 3)  # p = 0: cheap checks only, held
    st = pool.op.status()
    assert (st.groups_held, st.groups_pending, len(feed(pool))) == (3, 0, K)
    pool.verifier.policy.sample_rate = 1.0
    rounds(pool, node, 1)
    groups = feed(pool)
    assert len(groups) == K + 4 and pool.op.status().groups_held == 0
    # Released in submission order, before the group whose check released them.
    ids = [g["id"] for g in pool.groups(node.node_id) if g["status"] == "accepted"]
    by_seq = sorted(pool.groups(node.node_id), key=lambda g: g["accepted_seq"])
    assert [g["id"] for g in by_seq] == sorted(ids)
    row = pool.node_row(node.node_id)
    assert (row.checks_passed, row.groups_accepted, row.banned) == (K + 1, K + 4, False)
    assert row.reputation > 0.8


def test_node_turning_bad_after_k_loses_its_held_groups_and_identity(pool):
    node = pool.node(Sleeper, max_prompts=1, edit=bad.edit_token)
    rounds(pool, node, K)
    node.cheating = True
    rounds(pool, node, 3)  # edited tokens pass the cheap checks: held, not trained on
    assert pool.op.status().groups_held == 3 and len(feed(pool)) == K
    pool.verifier.policy.sample_rate = 1.0
    rounds(pool, node, 1)
    assert len(feed(pool)) == K
    statuses = [(g["status"], g["reason"][:12]) for g in pool.groups(node.node_id)]
    assert statuses == [("accepted", "")] * K + [("rejected", "node banned")] * 3 + [("rejected", "replay: roll")]
    row = pool.node_row(node.node_id)
    assert row.banned and pool.op.status().groups_held == 0
    with pytest.raises(CoordinatorError) as e:
        node.step()
    assert e.value.status == 403


def test_cheap_checks_reject_at_once_even_when_sampled_out(pool):
    class ClaimSleeper(bad.ClaimNode):
        cheating = False

        def tamper(self, submission, lease):
            return super().tamper(submission, lease) if self.cheating else submission

    node = pool.node(ClaimSleeper, max_prompts=1)
    rounds(pool, node, K)
    node.cheating = True
    rounds(pool, node, 1)  # sampled out (p = 0), but the claimed-reward check is a cheap one
    assert pool.node_row(node.node_id).banned
    assert pool.verifier.stats.full_checks == K and len(feed(pool)) == K


def test_release_needs_a_check_of_a_later_group(pool):
    node = pool.node(max_prompts=2)
    node.step()
    first, second = pool.op.pending(limit=10)
    rewards = [0.0] * len(first.group.rollouts)
    # The later group is held; a passed check of the earlier one does not vouch for it.
    pool.op.verdicts([m.Verdict(group_id=second.group_id, accepted=True, rewards=rewards, checked=False),
                      m.Verdict(group_id=first.group_id, accepted=True, rewards=rewards)])
    assert [g.group_id for g in feed(pool)] == [1] and pool.op.status().groups_held == 1
    node.step()
    third, _ = pool.op.pending(limit=10)
    pool.op.verdicts([m.Verdict(group_id=third.group_id, accepted=True, rewards=rewards)])
    assert len(feed(pool)) == 3 and pool.op.status().groups_held == 0
    # A verdict on a held group is ignored (it is decided).
    pool.op.verdicts([m.Verdict(group_id=second.group_id, accepted=False, ban=True)])
    assert not pool.node_row(node.node_id).banned


def test_each_group_is_checked_with_its_own_version(pool, tmp_path):
    pool.verifier.policy.warmup_checks = 100  # full checks throughout
    old = pool.node(name="old", max_prompts=1)
    pool.publish(perturb_checkpoint(pool.versions[0], tmp_path / "v1", 0.01))
    new = pool.node(name="new", max_prompts=1)
    old.step()  # still generating with version 0: within max_staleness = 1
    new.step()
    pool.verify_all()
    versions = sorted(g.policy_version for g in feed(pool))
    assert versions == [0, 1]
    assert not any(g["status"] == "rejected" for g in pool.groups())
