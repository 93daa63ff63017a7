"""The quarantine rule (`protocol.quarantine`) and its bound (docs/quarantine.md), without a server:

- the rule's two functions do what the docstring says (warm-up, draw, held cap, vouching, release order);
- the attacker's optimum (dynamic programming over every strategy) stays under the closed-form bound, and the
  rule's own functions, simulated under that optimal strategy, give the optimum's yield (the model is the code);
- no strategy of a family around it (batches of c cheats, cheating at random, cheating on everything) beats
  the bound beyond sampling error, at p = 0.1 and 0.25 with the default K, m, h;
- the old rule (K = 8, any later pass releases, no cap) lets the same attackers poison far more than 1%.
"""

from __future__ import annotations

import math

import pytest

from swarmrl.protocol import quarantine as q
from swarmrl.protocol.quarantine import Check, Held, Rules
from swarmrl.testing.byzantine import quarantine_sim as sim

A = q.ATTACKER_SHARE
WORK = 60_000
"""Honest groups of attacker work per simulation: about 120 identities at the defaults (a few tenths of a second)."""
OLD = dict(warmup_checks=8, release_passes=1, max_held=10**9)
"""The rule before issue 16: K = 8, released by any later passed check, no cap on held groups."""


# -- the rule --------------------------------------------------------------------------------------------------------


def test_decide_warmup_draw_and_cap():
    r = Rules(warmup_checks=3, sample_rate=0.25, max_held=2)
    assert q.decide(r, passes=2, held=0, draw=0.99) is Check.WARMUP
    assert q.decide(r, passes=3, held=0, draw=0.2) is Check.SAMPLED
    assert q.decide(r, passes=3, held=1, draw=0.3) is Check.HOLD
    assert q.decide(r, passes=3, held=2, draw=0.3) is Check.OVERFLOW
    assert q.decide(r, passes=3, held=2, draw=0.1) is Check.SAMPLED  # a drawn check stays a vouching one
    assert [c.full for c in Check] == [True, True, True, False]
    assert [c.vouches for c in Check] == [True, True, False, False]


@pytest.mark.parametrize("kw", [dict(warmup_checks=-1), dict(sample_rate=1.5), dict(sample_rate=-0.1),
                                dict(release_passes=0), dict(max_held=-1)])
def test_rules_refuse_nonsense(kw):
    with pytest.raises(ValueError):
        Rules(**kw)


def test_a_vouching_pass_releases_earlier_groups_after_m():
    held = [Held(7), Held(3, vouches=1), Held(12)]
    out = q.on_pass(held, group_id=10, vouches=True, release_passes=2)
    assert out.released == (3,)  # had one vouch, got its second
    assert out.still_held == (Held(7, 1), Held(12, 0))  # 12 was submitted after the checked group: no vouch
    out = q.on_pass(out.still_held, group_id=11, vouches=True, release_passes=2)
    assert out.released == (7,) and out.still_held == (Held(12, 0),)


def test_a_pass_that_cannot_vouch_releases_nothing():
    held = [Held(1), Held(2)]
    out = q.on_pass(held, group_id=5, vouches=False, release_passes=1)
    assert out.released == () and out.still_held == (Held(1), Held(2))
    assert q.on_pass(held, group_id=5, vouches=True, release_passes=1).released == (1, 2)  # oldest first


def test_warmup_for_meets_the_target_and_the_default_does():
    for p in (0.05, 0.1, 0.25, 0.5):
        k = q.warmup_for(p)
        assert q.poisoned_share_bound(Rules(warmup_checks=k, sample_rate=p)) <= q.TARGET_SHARE
        assert q.poisoned_share_bound(Rules(warmup_checks=k - 1, sample_rate=p)) > q.TARGET_SHARE
    assert q.WARMUP_CHECKS >= q.warmup_for(q.SAMPLE_RATE)
    assert q.poisoned_share_bound(Rules()) <= q.TARGET_SHARE
    assert q.poisoned_share_bound(Rules(sample_rate=0.25)) <= q.TARGET_SHARE
    assert q.poisoned_share_bound(Rules(**OLD)) > 0.3
    assert q.poisoned_share_bound(Rules(sample_rate=0.0)) == 1.0


# -- the attacker's optimum and the bound ------------------------------------------------------------------------------


@pytest.mark.parametrize("p,k,m", [(0.1, q.WARMUP_CHECKS, 1), (0.25, q.WARMUP_CHECKS, 1), (0.1, 100, 1),
                                   (0.25, 40, 1), (0.1, 100, 2), (0.25, 150, 3)])
def test_optimum_is_under_the_closed_form_bound(p, k, m):
    opt = sim.optimal_yield(Rules(warmup_checks=k, sample_rate=p, release_passes=m))
    bound = q.poison_per_work_bound(p, k)
    assert 0 < opt.yield_per_work <= bound
    assert opt.yield_per_work > 0.6 * bound  # and the bound is not far off: it is what the rule really allows
    assert all(sum(s) < opt.max_cheats for s in opt.cheat_in)  # the state space was large enough


@pytest.mark.parametrize("p", [0.1, 0.25])
def test_the_simulated_rule_yields_the_optimum(p):
    rules = Rules(sample_rate=p)
    opt = sim.optimal_yield(rules)
    res = sim.simulate(rules, sim.optimal(opt), WORK, seed=1)
    assert abs(res.yield_per_work - opt.yield_per_work) <= 3.5 * res.yield_stderr, (res.yield_per_work, opt)


def strategies(rules: Rules) -> list[sim.Strategy]:
    return [sim.optimal(sim.optimal_yield(rules)), *(sim.batch(c) for c in (1, 2, 3, 5, 10, 10**6)),
            sim.mixed(0.02), sim.mixed(0.2)]


@pytest.mark.parametrize("p", [0.1, 0.25])
def test_no_strategy_beats_the_bound(p):
    rules = Rules(sample_rate=p)
    bound = q.poison_per_work_bound(p, rules.warmup_checks)
    for i, strategy in enumerate(strategies(rules)):
        res = sim.simulate(rules, strategy, WORK, seed=10 + i)
        assert res.yield_per_work <= bound + 3 * res.yield_stderr, (strategy.__name__, res.yield_per_work, bound)
        assert res.share(A) <= res.share(A, conservative=True)
        assert res.share(A, conservative=True) <= sim.share(bound + 3 * res.yield_stderr, A)


@pytest.mark.parametrize("p", [0.1, 0.25])
def test_the_old_rule_fails_the_target(p):
    rules = Rules(sample_rate=p, **OLD)
    opt = sim.optimal_yield(rules)
    assert sim.share(opt.yield_per_work, A, 1.0) > 5 * q.TARGET_SHARE
    for strategy in (sim.optimal(opt), sim.batch(1)):  # the best one, and issue 16's script
        res = sim.simulate(rules, strategy, WORK // 4, seed=3)
        assert res.share(A) - 3 * res.yield_stderr > q.TARGET_SHARE, (strategy.__name__, res.share(A))


# -- what honest nodes pay -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p,h", [(0.1, q.MAX_HELD), (0.25, q.MAX_HELD), (0.1, 10)])
def test_honest_check_rate_and_release_delay(p, h):
    rules = Rules(warmup_checks=50, sample_rate=p, max_held=h)
    n = 40_000
    res = sim.simulate_honest(rules, n, seed=5)
    expected = q.honest_check_rate(rules, lifetime=n)
    # Checks per group after the warm-up are Bernoulli-like with variance <= 1/4 per group.
    assert abs(res.check_rate - expected) <= 4 * math.sqrt(0.25 / n) + 1e-3, (res.check_rate, expected)
    assert res.overflow / n <= 3 * (1 - p) ** (h + 1)  # overflow checks are rare unless h is small
    assert abs(res.mean_release_delay - 1 / p) < 0.15 / p  # a held group waits ~1/p of the node's groups
