"""Choosing the data by its outcome (bench/byzantine.py, adaptive part; tests/test_selection.py).

An attacker generates honestly and submits only the groups it likes, those with some property; it leaves the
others out of its submissions (they are abandoned, leased again to someone else). An honest node on another
source keeps working beside it. `selective_submission_gain` is how far the property's share among the groups
trained on for the attacker's prompts rises above its share among the groups the attacker generated for them.
A dropped prompt comes back with the seeds it had (`coordinator.admission`), so on the same policy version the
honest node reproduces the very group the attacker dropped, and the gain is nothing; with fresh seeds (before),
each dropped group was replaced by a fresh draw, which has the property as often as any.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any

from swarmrl.protocol import messages as m
from swarmrl.testing.byzantine.harness import Pool, ScriptedNode, open_pool


def liked(group: m.RolloutGroup) -> bool:
    """The property the attacker selects for: the first rollout's first token is even (about half of groups)."""
    first = group.rollouts[0].completion_ids
    return bool(first) and first[0] % 2 == 0


class Selective(ScriptedNode):
    """Generates honestly; submits only the groups `liked` (the first one when it likes none: a submission holds
    one at least). Records every group it generated and which it submitted, by (prompt text, seeds)."""

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.generated: dict[tuple[str, tuple[int, ...]], bool] = {}
        self.submitted: set[tuple[str, tuple[int, ...]]] = set()

    def tamper(self, submission: m.RolloutSubmission, lease: m.Lease) -> m.RolloutSubmission:
        prompts = {p.prompt_id: p for p in lease.prompts}
        key = {g.prompt_id: (prompts[g.prompt_id].text, tuple(prompts[g.prompt_id].seeds)) for g in submission.groups}
        for g in submission.groups:
            self.generated[key[g.prompt_id]] = liked(g)
        kept = [g for g in submission.groups if liked(g)] or submission.groups[:1]  # a submission has a group
        self.submitted.update(key[g.prompt_id] for g in kept)
        return submission.model_copy(update={"groups": kept})


class Recording(ScriptedNode):
    """An honest node that records the property of every group it submits, by (prompt text, seeds)."""

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.made: dict[str, list[tuple[tuple[int, ...], bool]]] = {}

    def tamper(self, submission: m.RolloutSubmission, lease: m.Lease) -> m.RolloutSubmission:
        prompts = {p.prompt_id: p for p in lease.prompts}
        for g in submission.groups:
            p = prompts[g.prompt_id]
            self.made.setdefault(p.text, []).append((tuple(p.seeds), liked(g)))
        return submission


def _queued(pool: Pool) -> int:
    con = sqlite3.connect(f"file:{pool.cfg.data_dir / 'coordinator.sqlite'}?mode=ro", uri=True)
    try:
        return int(con.execute("SELECT count(*) FROM prompt_queue").fetchone()[0])
    finally:
        con.close()


def run(pool: Pool, leases: int, prompts: int = 4, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """`leases` leases of `prompts` prompts for the attacker, each followed by the honest node working until no
    abandoned prompt waits. Compares, over the attacker's prompts, the property's share among the groups it
    generated and among the groups trained on (its own submitted ones and the honest node's for the prompts it
    dropped)."""
    attacker = pool.node(Selective, name="selective", max_prompts=prompts)
    honest = pool.node(Recording, name="honest", max_prompts=prompts, source="127.0.0.2")
    for i in range(leases):
        if not attacker.step():
            raise RuntimeError("the attacker got no lease")
        submitted = {g.prompt_id for g in attacker.last_submission.groups} if attacker.last_submission else set()
        dropped = [p for p in attacker.last_lease.prompts if p.prompt_id not in submitted]
        if dropped and not honest.step():
            raise RuntimeError("the honest node got no lease")
        pool.verify_all()
        if (i + 1) % 20 == 0:
            log(f"selection: {i + 1}/{leases} leases")
    # The honest node's next lease comes with its submission, drawn before the attacker's latest drops were queued:
    # it takes them a lease or two later.
    for _ in range(8):
        dropped = [key for key in attacker.generated if key not in attacker.submitted]
        if not _queued(pool) and all(text in honest.made for text, _ in dropped):
            break
        if not honest.step():
            raise RuntimeError("the honest node got no lease")
        pool.verify_all()
    trained, same_group, used = [], 0, {}
    for (text, seeds), ok in attacker.generated.items():
        if (text, seeds) in attacker.submitted:
            trained.append(ok)  # every group is fully checked here, and an honest one accepted
            continue
        again = honest.made.get(text, [])[used.get(text, 0):]
        if again:  # the first time the honest node generated it after the attacker dropped it
            used[text] = used.get(text, 0) + 1
            again_seeds, again_ok = again[0]
            same_group += again_seeds == seeds and again_ok == ok
            trained.append(again_ok)
    generated = list(attacker.generated.values())
    share_generated = sum(generated) / len(generated)
    share_trained = sum(trained) / len(trained)
    return {"leases": leases, "generated": len(generated), "trained": len(trained),
            "dropped": len(generated) - len(attacker.submitted), "dropped_regenerated_identically": same_group,
            "share_generated": round(share_generated, 4), "share_trained": round(share_trained, 4),
            "selective_submission_gain": round(share_trained - share_generated, 4)}


def section(root: Any, ckpt: Any, leases: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The bench's arm: every group fully checked (accepted at once), one policy version."""
    with open_pool(root, ckpt, verifier={"warmup_checks": 10**6}) as pool:
        return run(pool, leases, log=log)
