"""A group's draw is final (docs/quarantine.md, "Re-claims and crashed verifiers"): a check that outlasts its
claim cannot have the group drawn again, and a failed check bans whatever verdict landed first. Real
coordinator on loopback, real verifiers."""

from __future__ import annotations

import random
import sqlite3

import pytest

from swarmrl.protocol import messages as m
from swarmrl.testing.byzantine import nodes as bad
from swarmrl.testing.byzantine import reclaims
from swarmrl.testing.byzantine.harness import make_checkpoint, open_pool

P = 0.5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "v0")


def test_a_reclaimed_group_keeps_its_draw_and_a_late_failed_check_still_bans(tmp_path, ckpt):
    with open_pool(tmp_path, ckpt, claim_ttl_s=1e-6) as pool:
        node = pool.node(max_prompts=1)
        assert node.step()
        first = pool.op.pending(8)
        again = pool.op.pending(8)  # the first claim has expired: claimed again
        assert [g.group_id for g in first] == [g.group_id for g in again] and len(first) == 1
        assert (again[0].draw, again[0].node_checks_passed, again[0].node_held) == (
            first[0].draw, first[0].node_checks_passed, first[0].node_held)
        gid, n = first[0].group_id, len(first[0].group.rollouts)
        # The re-claimer's hold lands first; the first claimer's failed check lands after it.
        pool.op.verdicts([m.Verdict(group_id=gid, accepted=True, rewards=[0.0] * n, checked=False)])
        assert pool.groups(node.node_id)[0]["held"] == 1
        pool.op.verdicts([m.Verdict(group_id=gid, accepted=False, ban=True, reason="replay failed")])
        assert pool.node_facts(node.node_id)[1]  # banned
        assert [(g["status"], g["reason"]) for g in pool.groups(node.node_id)] == [("rejected", "node banned")]
        con = sqlite3.connect(f"file:{pool.cfg.data_dir / 'coordinator.sqlite'}?mode=ro", uri=True)
        try:
            assert con.execute("SELECT ban_reason FROM nodes WHERE id = ?", (node.node_id,)).fetchone() == (
                "replay failed",)
        finally:
            con.close()


def test_two_racing_verifiers_catch_exactly_the_cheats_the_first_draw_picks(tmp_path, ckpt):
    """Whenever A's draw picks a full check, B re-claims the group while A checks it, and B's verdict lands first.
    With draws made again on a re-claim, a cheat A's draw picked escaped whenever B's draw held it; now the cheats
    caught are exactly those whose (first and only) draw was below p."""
    rounds, seed = 10, 3
    vcfg = {"warmup_checks": 0, "sample_rate": P, "max_held": 10**6}
    with open_pool(tmp_path, ckpt, verifier=vcfg, claim_ttl_s=1e-6, draw_seed=seed) as pool:
        res = reclaims.run(pool, rounds, bad.Truth(ckpt))
    draws = random.Random(seed)
    picked = [i for i in range(rounds) if draws.random() < P]  # one group, so one draw, per round
    assert res["reclaimed"] == len(picked)  # each group A checked was claimed by B too
    assert 0 < len(picked) < rounds  # the seed gives both outcomes
    assert res["caught_rounds"] == picked
