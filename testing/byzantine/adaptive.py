"""Adaptive attackers with free identities against a real pool (`harness.open_pool`): the strategies of
`quarantine_sim`, played through the real coordinator and verifier, counting the poisoned groups that reach the
trainer feed (bench/byzantine.py, adaptive part; docs/quarantine.md).

The attacker holds a share a of the throughput: per round, the honest nodes generate their leases, and the
attacker generates a / (1 - a) times as many honest groups, plus whatever cheating groups its strategy sends
(cheats are free, as in the bound). It sends one group at a time and sees every verdict before its next group
(the verifier drains the queue after each): before each group it reads its identity's passed checks, held groups
and their vouches from the coordinator's database, and decides with the strategy. A cheating group has one
token edited in one rollout, re-annotated with the true model's logprobs and proof, so only the full check's
replay can catch it. When its identity is banned it registers a new key.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmrl.protocol import messages as m
from swarmrl.protocol import quarantine
from swarmrl.protocol.quarantine import Held, Rules
from swarmrl.runtime.client import CoordinatorError
from swarmrl.testing.byzantine import nodes as bad
from swarmrl.testing.byzantine.harness import Pool, ScriptedNode, open_pool
from swarmrl.testing.byzantine.quarantine_sim import Strategy, View, batch, optimal, optimal_yield


def cheat_edit(r, prompt_ids, truth, rng, sampling):
    """One token before the last replaced (`nodes.edit_token`); for a group with no rollout long enough, a made-up
    completion (`nodes.made_up_completion`). Both are re-annotated with the true model: only replay catches them."""
    return bad.edit_token(r, prompt_ids, truth, rng, sampling)


cheat_edit.fallback = bad.made_up_completion  # type: ignore[attr-defined]


class SwitchNode(bad.EditNode):
    """An identity of the attacker: honest unless `cheating` is set for its next step."""

    cheating = False

    def tamper(self, submission: m.RolloutSubmission, lease: m.Lease) -> m.RolloutSubmission:
        return super().tamper(submission, lease) if self.cheating else submission


@dataclass
class Attacker:
    pool: Pool
    strategy: Strategy
    rules: Rules
    truth: bad.Truth
    rng: random.Random
    engine: str = "torch"
    node: SwitchNode | None = None
    cheats: set[int] = field(default_factory=set)
    """Ids of every cheating group it submitted (all identities)."""
    identities: list[str] = field(default_factory=list)
    honest_groups: int = 0
    cheat_groups: int = 0

    def _new_identity(self) -> SwitchNode:
        if self.node is not None and self.node.engine is not None:
            self.node.engine.close()
        node = self.pool.node(SwitchNode, name=f"adaptive{len(self.identities)}", engine=self.engine, max_prompts=1,
                              edit=cheat_edit, seed=self.rng.getrandbits(32), truth=self.truth)
        self.identities.append(node.node_id)
        self.node = node
        return node

    def view(self) -> tuple[View, bool]:
        """What its current identity knows, and whether it is banned."""
        assert self.node is not None
        passes, banned = self.pool.node_facts(self.node.node_id)
        held = [Held(g["id"], g["vouches"]) for g in self.pool.groups(self.node.node_id)
                if g["status"] == "pending" and g["held"]]
        return View(self.rules, passes, held, {h.group_id for h in held} & self.cheats), banned

    def step(self) -> None:
        """Send one group (a new identity first if the last one was banned)."""
        node = self.node or self._new_identity()
        view, banned = self.view()
        if banned:
            node = self._new_identity()
            view, _ = self.view()
        node.cheating = self.strategy(view, self.rng)
        before = {g["id"] for g in self.pool.groups(node.node_id)}
        try:
            node.step()
        except CoordinatorError as e:
            if e.status != 403:  # banned meanwhile: the next step takes a new identity
                raise
            return
        new = [g["id"] for g in self.pool.groups(node.node_id) if g["id"] not in before]
        if node.cheating:
            self.cheats.update(new)
            self.cheat_groups += len(new)
        else:
            self.honest_groups += len(new)

    def close(self) -> None:
        if self.node is not None and self.node.engine is not None:
            self.node.engine.close()


def run(pool: Pool, attacker: Attacker, honest: list[ScriptedNode], work: int, attacker_share: float) -> dict[str, Any]:
    """Rounds of honest leases and attacker groups until the attacker generated `work` honest groups; then the
    counts: poisoned groups in the trainer feed, all groups there, the honest nodes' checks and rejections."""
    t0 = time.time()
    honest_ids = {h.node_id for h in honest}
    honest_groups = 0
    while attacker.honest_groups < work:
        for h in honest:
            h.sync()
            h.step()
        honest_groups = sum(len(pool.groups(nid)) for nid in honest_ids)
        target = honest_groups * attacker_share / (1 - attacker_share)
        while attacker.honest_groups < min(target, work):
            attacker.step()
            pool.verify_all()
        pool.verify_all()
    groups = pool.groups()
    accepted = [g for g in groups if g["status"] == "accepted"]
    mine = [g for g in groups if g["node_id"] in honest_ids]
    checked = [g for g in mine if g["id"] in pool.verifier.reports]
    poisoned = sum(g["id"] in attacker.cheats for g in accepted)
    banned = sum(pool.node_facts(nid)[1] for nid in attacker.identities)
    return {
        "attacker_honest_groups": attacker.honest_groups, "attacker_cheat_groups": attacker.cheat_groups,
        "attacker_share_measured": round(attacker.honest_groups / max(attacker.honest_groups + len(mine), 1), 4),
        "identities": len(attacker.identities), "identities_banned": banned,
        "poisoned": poisoned, "trained_on": len(accepted),
        "poisoned_share": round(poisoned / max(len(accepted), 1), 5),
        "poisoned_per_attacker_honest_group": round(poisoned / max(attacker.honest_groups, 1), 5),
        "honest_groups": len(mine), "honest_rejected": sum(g["status"] == "rejected" for g in mine),
        "honest_held_at_end": sum(g["status"] == "pending" and g["held"] for g in mine),
        "honest_nodes_banned": sum(pool.node_facts(nid)[1] for nid in honest_ids),
        "honest_check_rate": round(len(checked) / max(len(mine), 1), 4),
        "verifier_check_seconds": round(pool.verifier.stats.check_seconds, 2),
        "wall_s": round(time.time() - t0, 1),
    }


RULES = ("default", "old", "scaled")


def rules_named(name: str, p: float) -> Rules:
    """default: `protocol.quarantine`'s K, m, h; old: the rule before issue 16 (K = 8, any later pass releases, no
    cap); scaled: the default with K / 10, whose larger bound a short run can measure with few identities."""
    if name == "default":
        return Rules(sample_rate=p)
    if name == "old":
        return Rules(warmup_checks=8, sample_rate=p, max_held=10**9)
    if name == "scaled":
        return Rules(warmup_checks=quarantine.WARMUP_CHECKS // 10, sample_rate=p)
    raise ValueError(f"unknown rule {name!r}: one of {RULES}")


def section(root: Path, ckpt: Path, work: dict[str, int], engines: tuple[str, ...] = ("vllm", "torch"),
            p_values: tuple[float, ...] = (0.1, 0.25), attacker_share: float = quarantine.ATTACKER_SHARE,
            seed: int = 0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """At each p, for each rule of `work` (name -> attacker groups per run, see `rules_named`): the optimal
    strategy and issue 16's script (one cheat, then honest until a check released it). Each run a fresh pool
    with honest nodes on `engines` (8 prompts per lease). Returns the runs and, per rule and p, the worst
    poisoned share."""
    truth = bad.Truth(ckpt)
    sampling = m.SamplingSpec(temperature=1.0, max_tokens=16, group_size=8)
    runs: dict[str, Any] = {}
    worst: dict[str, dict[str, float]] = {name: {} for name in work}
    for p in p_values:
        for rule_name, w in work.items():
            rules = rules_named(rule_name, p)
            opt = optimal_yield(rules)
            for strat_name, strategy in (("optimal", optimal(opt)), ("issue16", batch(1))):
                name = f"p={p:g}/{rule_name}/{strat_name}"
                d = root / name.replace("/", "-").replace("=", "")
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir(parents=True)
                # A seed of its own per run: runs sharing one would share their draws, and their luck.
                vcfg = {"warmup_checks": rules.warmup_checks, "sample_rate": p, "max_held": rules.max_held,
                        "policy_seed": seed + len(runs)}
                with open_pool(d, ckpt, sampling=sampling, verifier=vcfg, draw_seed=seed + len(runs)) as pool:
                    honest = [pool.node(name=f"honest-{e}", engine=e, max_prompts=8) for e in engines]
                    attacker = Attacker(pool, strategy, rules, truth, random.Random(seed + len(runs)))
                    try:
                        res = run(pool, attacker, honest, w, attacker_share)
                    finally:
                        attacker.close()
                        for h in honest:
                            if h.engine is not None:
                                h.engine.close()
                res["rules"] = {"K": rules.warmup_checks, "p": p, "m": rules.release_passes,
                                "h": rules.max_held if rules.max_held < 10**9 else None}
                res["predicted_poisoned_per_attacker_honest_group"] = round(opt.yield_per_work, 5)
                res["predicted_share_bound"] = round(quarantine.poisoned_share_bound(rules, attacker_share), 5)
                runs[name] = res
                key = f"{p:g}"
                worst[rule_name][key] = max(worst[rule_name].get(key, 0.0), res["poisoned_share"])
                log(f"adaptive {name}: {json.dumps(res)}")
    return {"runs": runs, "poisoned_share_by_rule": worst}
