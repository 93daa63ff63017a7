"""The check rule (`protocol.quarantine`) and the coordinator's quarantine, end to end with real nodes,
coordinator and verifier:
- after K passed checks, sampled-out groups are held, and reach the trainer only when a later check passes;
- a node that turns bad after K loses its held groups and its identity at the first failed check;
- only a check of a *later* group releases a held one; cheap checks still reject held-mode groups at once;
- with m = 2 a held group needs two vouching passes; a forced (overflow) check vouches for nothing;
- an identity over its verification budget is deferred before any draw; a crashed full check bans;
- each group is verified against the weights of its own policy version (within the staleness bound).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from swarmrl.protocol import messages as m
from swarmrl.protocol.quarantine import Rules
from swarmrl.runtime.client import CoordinatorError
from swarmrl.testing.byzantine import adaptive
from swarmrl.testing.byzantine import nodes as bad
from swarmrl.testing.byzantine import quarantine_sim as sim
from swarmrl.testing.byzantine.harness import make_checkpoint, open_pool, perturb_checkpoint
from swarmrl.verifier.budget import IdentityBudget

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
    pool.verifier.policy.rules = replace(pool.verifier.policy.rules, sample_rate=1.0)
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
    pool.verifier.policy.rules = replace(pool.verifier.policy.rules, sample_rate=1.0)
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
    # Another verdict on a decided group changes nothing, unless it bans: a failed check is final whatever
    # landed first (docs/quarantine.md); what was released stays released.
    pool.op.verdicts([m.Verdict(group_id=second.group_id, accepted=False, reason="again")])
    assert not pool.node_row(node.node_id).banned and len(feed(pool)) == 3
    pool.op.verdicts([m.Verdict(group_id=second.group_id, accepted=False, ban=True)])
    assert pool.node_row(node.node_id).banned and len(feed(pool)) == 3


def test_each_group_is_checked_with_its_own_version(pool, tmp_path):
    pool.verifier.policy.rules = replace(pool.verifier.policy.rules, warmup_checks=100)  # all checked
    old = pool.node(name="old", max_prompts=1)
    pool.publish(perturb_checkpoint(pool.versions[0], tmp_path / "v1", 0.01))
    new = pool.node(name="new", max_prompts=1)
    old.step()  # still generating with version 0: within max_staleness = 1
    new.step()
    pool.verify_all()
    versions = sorted(g.policy_version for g in feed(pool))
    assert versions == [0, 1]
    assert not any(g["status"] == "rejected" for g in pool.groups())


def test_release_after_m_vouching_passes_and_not_by_a_forced_check(tmp_path, ckpt):
    with open_pool(tmp_path, ckpt, release_passes=2) as pool:
        node = pool.node(max_prompts=4)
        node.step()
        g1, g2, g3, g4 = pool.op.pending(limit=10)
        assert g1.node_held == 0
        rewards = [0.0] * len(g1.group.rollouts)

        def verdict(g, **kw):
            pool.op.verdicts([m.Verdict(group_id=g.group_id, accepted=True, rewards=rewards, **kw)])

        verdict(g1, checked=False)
        verdict(g2)  # vouches: g1 has 1 of 2
        verdict(g3, vouches=False)  # a check the node could foresee: no vouch
        assert {g["id"]: g["status"] for g in pool.groups()}[g1.group_id] == "pending"
        verdict(g4)  # the second vouch: g1 is released, before g4
        order = [g["id"] for g in sorted(pool.groups(), key=lambda g: g["accepted_seq"])]
        assert order == [g2.group_id, g3.group_id, g1.group_id, g4.group_id]
        node.step()
        held_now = pool.op.pending(limit=10)
        pool.op.verdicts([m.Verdict(group_id=held_now[0].group_id, accepted=True, rewards=rewards, checked=False)])
        pool.op.verdicts([])  # an empty batch changes nothing
        node.step()
        assert {p.node_held for p in pool.op.pending(limit=20)} == {1}  # the claim says what the node holds


def test_an_overflow_check_is_forced_at_the_cap_and_vouches_for_nothing(tmp_path, ckpt):
    cfg = {"warmup_checks": 1, "sample_rate": 0.0, "max_held": 2, "policy_seed": 0}
    with open_pool(tmp_path, ckpt, verifier=cfg) as pool:
        node = pool.node(max_prompts=1)
        rounds(pool, node, 3)  # warm-up pass, then two held
        assert pool.op.status().groups_held == 2 and pool.verifier.stats.full_checks == 1
        rounds(pool, node, 1)  # at the cap: checked, accepted, but the held stay held
        assert pool.op.status().groups_held == 2 and pool.verifier.stats.full_checks == 2
        assert len(feed(pool)) == 2
        pool.verifier.policy.rules = replace(pool.verifier.policy.rules, sample_rate=1.0)
        rounds(pool, node, 1)  # a drawn check vouches: both released
        assert pool.op.status().groups_held == 0 and len(feed(pool)) == 5


def test_an_identity_over_its_budget_is_deferred_before_any_draw(pool):
    now = [0.0]
    pool.verifier.budget = IdentityBudget(budget_s=1e-3, window_s=1000.0, clock=lambda: now[0])
    draws = []
    decide = pool.verifier.policy.decide
    pool.verifier.policy.decide = lambda *a: draws.append(a) or decide(*a)
    node = pool.node(max_prompts=2)
    node.step()
    first, second = pool.op.pending(limit=10)
    verdicts = pool.verifier.verify([first])  # a warm-up check: charged
    assert [v.accepted for v in verdicts] == [True] and pool.verifier.budget.over(node.node_id)
    assert pool.verifier.verify([second]) == [] and len(draws) == 1 and pool.verifier.stats.deferred == 1
    now[0] += 1e9  # refilled (a check here takes far more than the 1 ms budget)
    verdicts += pool.verifier.verify([second])
    assert len(draws) == 2 and [v.accepted for v in verdicts] == [True, True]
    pool.op.verdicts(verdicts)
    assert len(feed(pool)) == 2


def test_identities_of_one_source_share_its_budget(pool):
    """Free identities from one machine share one bucket: what one spent defers the others' groups; another
    source's are checked."""
    now = [0.0]
    pool.verifier.budget = None
    pool.verifier.source_budget = IdentityBudget(budget_s=1e-3, window_s=1000.0, clock=lambda: now[0])
    first, sybil = pool.node(name="first", max_prompts=1), pool.node(name="sybil", max_prompts=1)
    elsewhere = pool.node(name="elsewhere", max_prompts=1, source="127.0.0.2")
    for node in (first, sybil, elsewhere):
        node.step()
    groups = {g.node_id: g for g in pool.op.pending(limit=10)}
    assert groups[first.node_id].node_source == groups[sybil.node_id].node_source == "127.0.0.1"
    assert groups[elsewhere.node_id].node_source == "127.0.0.2"
    assert [v.accepted for v in pool.verifier.verify([groups[first.node_id]])] == [True]  # a warm-up check: charged
    assert pool.verifier.verify([groups[sybil.node_id]]) == [] and pool.verifier.stats.deferred == 1
    assert [v.accepted for v in pool.verifier.verify([groups[elsewhere.node_id]])] == [True]


def test_a_full_check_that_crashes_counts_as_failed(pool, monkeypatch):
    import swarmrl.verifier.service as service

    def crash(*a, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(service, "full_check", crash)
    node = pool.node(max_prompts=1)
    rounds(pool, node, 1)
    (g,) = pool.groups(node.node_id)
    assert g["status"] == "rejected" and "could not be completed" in g["reason"]
    assert pool.node_row(node.node_id).banned


def test_budget_bucket_refills_and_forgets():
    now = [0.0]
    b = IdentityBudget(budget_s=10.0, window_s=100.0, clock=lambda: now[0], max_identities=2)
    assert not b.over("a")
    b.charge("a", 12.0)
    assert b.over("a") and b.level("a") == pytest.approx(-2.0)
    now[0] = 30.0  # +3 s
    assert not b.over("a") and b.level("a") == pytest.approx(1.0)
    b.charge("b", 1.0)
    b.charge("c", 1.0)  # "a" is forgotten: a full bucket again
    assert b.level("a") == 10.0
    with pytest.raises(ValueError):
        IdentityBudget(0.0, 1.0)


@pytest.mark.parametrize("k,poisons", [(2, True), (1000, False)])
def test_an_adaptive_attacker_with_free_identities_live(tmp_path, ckpt, k, poisons):
    """The bench's attacker, small: batches of 2 cheats, honest until they are released, a new key when banned.
    With K = 2 it gets cheats into the trainer feed through the real coordinator; with K beyond its work, none
    (and it never even cheats: every check of a young identity is certain)."""
    rules = Rules(warmup_checks=k, sample_rate=0.25)
    cfg = {"warmup_checks": k, "sample_rate": 0.25, "max_held": rules.max_held, "policy_seed": 1}
    with open_pool(tmp_path, ckpt, verifier=cfg, draw_seed=1) as pool:
        honest = [pool.node(name="honest", max_prompts=4)]
        attacker = adaptive.Attacker(pool, sim.batch(2), rules, bad.Truth(ckpt), random.Random(0))
        try:
            res = adaptive.run(pool, attacker, honest, work=24, attacker_share=1 / 3)
        finally:
            attacker.close()
            honest[0].engine.close()
        accepted = {g["id"] for g in pool.groups() if g["status"] == "accepted"}
    assert res["poisoned"] == len(accepted & attacker.cheats) and res["trained_on"] == len(accepted)
    assert res["honest_rejected"] == 0 and res["honest_nodes_banned"] == 0
    assert res["attacker_share_measured"] == pytest.approx(1 / 3, abs=0.05)
    if poisons:
        assert res["poisoned"] >= 1 and res["identities"] >= 2 and res["identities_banned"] >= 1
    else:
        assert res["poisoned"] == 0 and res["attacker_cheat_groups"] == 0 and res["identities"] == 1


def test_rewards_are_computed_only_for_groups_that_are_held_or_passed(pool, monkeypatch):
    """Rewarding can cost far more than checking (a sandbox runs code): garbage must not buy it."""
    import swarmrl.verifier.service as service

    scored = []
    real = service.score
    monkeypatch.setattr(service, "score", lambda g, ctx: scored.append(g.group_id) or real(g, ctx))
    cheat = pool.node(bad.EditNode, name="garbage", max_prompts=2, edit=bad.made_up_completion)
    rounds(pool, cheat, 1)  # fails its full check (warm-up): never scored
    assert pool.node_row(cheat.node_id).banned and scored == []
    node = pool.node(max_prompts=1)
    rounds(pool, node, K + 1)  # K checked passes, then one held (p = 0): all scored
    assert scored == [g["id"] for g in pool.groups(node.node_id)]
