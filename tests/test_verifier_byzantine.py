"""The byzantine suite, small but complete: every attack of tests/byzantine against a real coordinator and the
real verifier logic (p = 1), twice each (variants alternate), with two honest torch-engine nodes working in
between. Every attempt must be detected, no honest group rejected, no attacker group trained on.

bench/byzantine.py runs the same suite with many more attempts, >= 1,000 honest groups and the vLLM engine.
"""

from __future__ import annotations

import pytest

from swarmrl.testing.byzantine.attacks import ATTACKS, run_suite
from swarmrl.testing.byzantine.harness import make_checkpoint, open_pool
from tests.support.byzantine import run_with_honest

ATTEMPTS = 2


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("byzantine")
    with open_pool(root, make_checkpoint(root / "ckpt")) as pool:
        honest = [pool.node(name="honest-a"), pool.node(name="honest-b")]
        results, honest_groups = run_with_honest(pool, honest, run_suite, ATTEMPTS)
        attackers = {g["node_id"] for g in pool.groups()} - {h.node_id for h in honest}
        yield results, honest_groups, pool, attackers


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attack_detected_every_attempt(suite, attack):
    results = suite[0][attack]
    assert len(results) == ATTEMPTS
    assert all(a.detected for a in results), [(a.stage, a.reason) for a in results]
    # A verifier rejection bans the node, unless the only fault was a missing proof.
    assert all(a.banned for a in results if a.stage == "verifier" and "no activation proof" not in a.reason)


def test_no_honest_group_rejected(suite):
    _, honest_groups, _, _ = suite
    # Two nodes, two groups a round; but right after stale_policy_version publishes versions past the staleness
    # bound, a node's lease granted with its last submission is too old: that round's submission is refused as
    # stale (409, its prompts leased again, the node not counted against), no group made.
    assert len(honest_groups) >= 2 * 2 * (len(ATTACKS) * ATTEMPTS + 1 - ATTEMPTS)
    assert [g["reason"] for g in honest_groups if g["status"] != "accepted"] == []


def test_a_ban_drops_everything_unreleased(suite):
    """Per attempt, `detected` already says no group of the attempt was trained on. Across the pool: a banned
    node's groups after its first rejection are all rejected, none is left held or pending."""
    _, _, pool, attackers = suite
    for nid in attackers:
        if not pool.node_row(nid).banned:
            continue
        groups = pool.groups(nid)
        first_bad = min(g["id"] for g in groups if g["status"] == "rejected")
        assert all(g["status"] == "rejected" for g in groups if g["id"] >= first_bad), groups
    assert pool.op.status().groups_held == 0 and pool.op.status().groups_pending == 0


def test_checks_fire_where_designed(suite):
    """Which full-check test catches what (first attempt): the layers each carry their own attack."""
    results = suite[0]
    assert "activation proof" in results["wrong_model_0.1pct"][0].caught_by  # the robust one on trained models
    assert "replay" in results["edited_token"][0].caught_by
    assert "replay" in results["edited_last_token"][0].caught_by
    assert "logprobs" in results["faked_logprobs"][0].caught_by
    assert set(results["wrong_model_1pct"][0].caught_by) >= {"logprobs", "activation proof"}
