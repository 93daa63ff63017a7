"""Multi-turn attackers (testing/byzantine/episodes.py) against a real coordinator and the real verifier (p = 1), on
a multi-turn run of the echo environment: honest multi-turn nodes are never rejected nor banned, and a node that
fakes, drops or adds an environment turn, samples later turns with the leased seed, or claims logprobs for
environment tokens is caught in every attempt.

bench/byzantine.py runs the same with more attempts and >= 500 honest groups (its multi-turn part).
"""

from __future__ import annotations

import pytest

from swarmrl.testing.byzantine import episodes as mt
from swarmrl.testing.byzantine.episodes import (
    MULTI_TURN_ATTACKS,
    SAMPLING,
    LyingNode,
    make_multi_turn_checkpoint,
    open_multi_turn_pool,
    run_multi_turn_suite,
)
from swarmrl.testing.groups import pending_group
from swarmrl.testing.local import verify_groups
from swarmrl.verifier.models import load_policy
from tests.support.byzantine import run_with_honest

ATTEMPTS = 2


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("byzantine-episodes")
    with open_multi_turn_pool(root, make_multi_turn_checkpoint(root / "ckpt")) as pool:
        honest = [pool.node(name="honest-a", max_prompts=4), pool.node(name="honest-b", max_prompts=4)]
        results, honest_groups = run_with_honest(pool, honest, run_multi_turn_suite, ATTEMPTS)
        yield results, honest_groups, pool, honest
        for h in honest:
            h.engine.close()


def test_honest_multi_turn_nodes_are_never_rejected(suite):
    _, honest_groups, pool, honest = suite
    assert len(honest_groups) == 2 * 4 * (len(MULTI_TURN_ATTACKS) * ATTEMPTS + 1)
    assert [g["reason"] for g in honest_groups if g["status"] != "accepted"] == []
    assert not any(pool.node_row(h.node_id).banned for h in honest)


def test_honest_episodes_have_several_turns(suite):
    """The pool plays real episodes: several model turns, ended by the environment, the turn limit or a turn's
    token limit."""
    _, _, _, honest = suite
    rollouts = [r for h in honest for g in h.last_submission.groups for r in g.rollouts]
    model_turns = [(len(r.turns) + 1) // 2 or 1 for r in rollouts]
    assert max(model_turns) == SAMPLING.max_turns and min(model_turns) < SAMPLING.max_turns


@pytest.mark.parametrize("attack", list(MULTI_TURN_ATTACKS))
def test_attack_detected_every_attempt(suite, attack):
    results = suite[0][attack]
    assert len(results) == ATTEMPTS
    assert all(a.detected and a.stage == "verifier" for a in results), [(a.stage, a.reason) for a in results]
    assert all(a.banned for a in results), [a.reason for a in results]


def test_each_attack_is_caught_by_the_check_meant_for_it(suite):
    """The environment replay (cheap checks) catches misreported environment turns; the full check's replay a
    later turn sampled with the wrong seed."""
    results = suite[0]
    for a in results["faked_env_turn"]:
        assert "not what the environment answers" in a.reason, a.reason
    for a in results["dropped_env_turn"]:
        assert "dropped" in a.reason or "ended 'length'" in a.reason, a.reason
    for a in results["added_env_turn"]:
        assert "the episode ends there" in a.reason or "ended 'stop'" in a.reason, a.reason
    for a in results["env_tokens_claim_logprobs"]:
        assert "claims logprobs" in a.reason or "claim logprobs" in a.reason, a.reason
    for a in results["leased_seed_later_turns"]:
        assert "replay" in a.caught_by, (a.caught_by, a.reason)


@pytest.mark.parametrize("lie", ["faked_reply", "dropped_reply", "added_reply"])
def test_a_lying_node_is_honest_but_for_its_lie(suite, lie):
    """What a node that fakes, drops or adds an environment turn submits passes every check, the full check's
    replay, logprobs and proofs included, when checked against its own environment: only the replay of the run's
    environment stands between it and the trainer."""
    _, _, pool, _ = suite
    for attempt in range(4):
        node = pool.node(LyingNode, name=f"unsent{lie}{attempt}", max_prompts=2, lie=getattr(mt, lie), at=1)
        node.load_ready_weights(SAMPLING.temperature)
        lease = node.client.lease(2, held_version=node.stats.held_version)
        sub = node.generate(lease)  # never submitted
        node.engine.close()
        if node.deviated:
            break
    assert node.deviated
    texts = {p.prompt_id: (p.text, p.seeds) for p in lease.prompts}
    groups = [pending_group(group_id=k + 1, prompt_text=texts[g.prompt_id][0], answer="0", sampling=lease.sampling,
                            seeds=texts[g.prompt_id][1], group=g) for k, g in enumerate(sub.groups)]
    policy = load_policy(pool.versions[0], 0)
    assert verify_groups(policy, groups, run=pool.cfg.run, env=node.liar)[0] == [None] * len(groups)
    reasons = verify_groups(policy, groups, run=pool.cfg.run, env=node.liar.true)[0]
    assert any(r is not None for r in reasons) and all(r is None or "environment" in r or "episode" in r
                                                       for r in reasons), reasons
