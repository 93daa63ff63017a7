"""Forgeries on the operator's links (bench/byzantine.py, adaptive part; tests/test_operator_links.py).

A man in the middle (`testing.mitm.Mitm`) sits between the coordinator and its verifier, or its trainer, and
rewrites what they are handed: one token of a pending group (the verifier would replay it, find that it differs,
and ban the honest node that sent it), a pending group's ground-truth answer (its claimed rewards would then
differ from the recomputed ones: a ban again), or the rewards or logprobs of the groups the trainer is fed. The
coordinator signs every answer to an operator, bound to the request it answers (`protocol.signing.verify_answer`),
and the verifier and the trainer refuse what does not verify. Side by side: the same clients with that check off
(`Unchecked`), the baseline that shows what the signature prevents.

A rewritten token is refused even with the answer check off: the verifier also checks the node's own signature of the
group (below). The coordinator itself can be the forger (its store or process tampered with: `store_forgery`): it
rewrites a stored group, a pending one or one already in the trainer's feed, and signs its answers as usual. Each group
carries its node's own signature (`protocol.groupsig`): the verifier refuses the rewritten group without a ban, and the
trainer passes it over.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from swarmrl.runtime.client import CoordinatorClient, CoordinatorError
from swarmrl.testing.byzantine.harness import Pool, open_pool
from swarmrl.testing.mitm import Mitm, Rewrite
from swarmrl.trainer.collect import forged
from swarmrl.verifier.service import Verifier

PENDING, BATCH = "/v1/verifier/pending", "/v1/trainer/batch"
FORGERIES = {"token": PENDING, "answer": PENDING, "rewards": BATCH, "logprobs": BATCH}
"""What is rewritten, and on which link."""
CONTROLS = {"untouched pending": PENDING, "untouched batch": BATCH}
"""The same links through the proxy, nothing rewritten: the checked clients must take these answers."""


def forge(what: str) -> Rewrite:
    """The rewrite of one answer: the first group's first token, answer, rewards or first logprob."""

    def rewrite(doc: dict[str, Any]) -> dict[str, Any]:
        first = doc["groups"][0]
        rollout = first["group"]["rollouts"][0]
        if what == "token":
            rollout["completion_ids"][0] = (rollout["completion_ids"][0] + 1) % 64
        elif what == "answer":
            first["answer"] = str(first["answer"]) + "7"
        elif what == "rewards":
            first["rewards"] = [1.0] * len(first["rewards"])
        elif what == "logprobs":
            rollout["logprobs"][0] = rollout["logprobs"][0] / 2
        else:
            raise ValueError(f"unknown forgery {what!r}: {', '.join(FORGERIES)}")
        return doc

    return rewrite


class Unchecked(CoordinatorClient):
    """An operator's client that takes the coordinator's answers unchecked (what verifiers and trainers did before
    answers were signed)."""

    def _signed(self, path: str, kind: str, payload: BaseModel, out: Any, answer_signed: bool = False) -> Any:
        return super()._signed(path, kind, payload, out, answer_signed=False)


def _verifier_behind(pool: Pool, url: str, checked: bool) -> Verifier:
    cfg = pool.verifier.cfg.model_copy(update={"coordinator_url": url, "work_dir": pool.root / "verifier-mitm"})
    v = Verifier(cfg, identity=pool.verifier.identity)
    if not checked:
        v.client = Unchecked(url, v.identity, retries=0, coordinator_key=pool.coordinator_key)
    return v


def attempt(pool: Pool, what: str, checked: bool) -> dict[str, Any]:
    """One honest group, then one forgery of `what` on its link. `accepted`: the operator acted on the forged
    answer (the verifier posted verdicts from it, the trainer got the batch); `honest_banned`: the honest node
    was banned."""
    node = pool.node(name=f"honest-{what}", max_prompts=1)
    if not node.step():
        raise RuntimeError("the honest node got no lease")
    path = {**FORGERIES, **CONTROLS}[what]
    if path == BATCH:
        pool.verify_all()  # the group reaches the feed, untouched
    with Mitm(pool.url, rewrite=forge(what) if what in FORGERIES else None, path=path) as proxy:
        if path == PENDING:
            verifier = _verifier_behind(pool, proxy.url, checked)
            try:
                verifier.poll_once()
                accepted = True
            except CoordinatorError:
                accepted = False
            finally:
                if verifier.models is not None:
                    verifier.models.close()
            pool.verify_all()  # what is left, judged on the coordinator's own words
        else:
            cls = CoordinatorClient if checked else Unchecked
            trainer = cls(proxy.url, pool.op.identity, retries=0, coordinator_key=pool.coordinator_key)
            try:
                trainer.training_batch(after_id=0, limit=64)
                accepted = True
            except CoordinatorError:
                accepted = False
        rewritten = proxy.rewritten
    return {"what": what, "checked": checked, "rewritten": rewritten, "accepted": accepted,
            "honest_banned": pool.node_facts(node.node_id)[1]}


STORE_FORGERIES = ("store pending", "store feed")
"""Groups rewritten in the coordinator's database: a pending one (the verifier's), an accepted one (the trainer's)."""


def _rewrite_stored(pool: Pool, group_id: int) -> None:
    """Change one completion token of stored group `group_id`, its node signature kept (a tampered store)."""
    con = sqlite3.connect(pool.cfg.data_dir / "coordinator.sqlite", timeout=60)
    try:
        with con:
            doc = json.loads(con.execute("SELECT payload FROM rollout_groups WHERE id = ?", (group_id,)).fetchone()[0])
            ids = doc["rollouts"][0]["completion_ids"]
            ids[0] = (ids[0] + 1) % 64
            con.execute("UPDATE rollout_groups SET payload = ? WHERE id = ?", (json.dumps(doc), group_id))
    finally:
        con.close()


def store_forgery(pool: Pool, what: str) -> dict[str, Any]:
    """One honest group, rewritten in the store while pending (`store pending`: the verifier then judges it) or once
    accepted (`store feed`: the trainer then reads it). `accepted`: the verifier accepted it or banned its node, or
    the trainer would train on it; `honest_banned`: the honest node was banned."""
    node = pool.node(name=f"honest-{what.replace(' ', '-')}", max_prompts=1)
    if not node.step():
        raise RuntimeError("the honest node got no lease")
    (row,) = pool.groups(node.node_id)
    if what == "store pending":
        _rewrite_stored(pool, row["id"])
        pool.verify_all()
        (row,) = pool.groups(node.node_id)
        accepted = row["status"] != "rejected" or "node signature" not in row["reason"]
    elif what == "store feed":
        pool.verify_all()
        (row,) = pool.groups(node.node_id)
        if row["accepted_seq"] is None:
            raise RuntimeError(f"the honest group was not accepted: {row}")
        _rewrite_stored(pool, row["id"])
        batch = pool.op.training_batch(after_id=row["accepted_seq"] - 1, limit=1)
        accepted = any(forged(g, pool.op.pool) is None for g in batch.groups)
    else:
        raise ValueError(f"unknown store forgery {what!r}: {', '.join(STORE_FORGERIES)}")
    return {"what": what, "checked": True, "rewritten": 1, "accepted": accepted,
            "honest_banned": pool.node_facts(node.node_id)[1]}


def section(root: Path, ckpt: Path, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every forgery, with and without the answer check, and the store's forgeries (checked by the node signatures):
    `operator_path_forgeries_accepted` (checked; must be 0) and the unchecked baseline's count."""
    rows = []
    # Every group fully checked; claims that end at once, so a group the forger's verifier claimed is judged again.
    with open_pool(root, ckpt, verifier={"warmup_checks": 10**6}, claim_ttl_s=1e-6) as pool:
        for checked in (True, False):
            for what in (*FORGERIES, *CONTROLS):
                rows.append(attempt(pool, what, checked))
                log(f"operator links: {rows[-1]}")
        for what in STORE_FORGERIES:
            rows.append(store_forgery(pool, what))
            log(f"operator links: {rows[-1]}")
    on = [r for r in rows if r["checked"] and r["what"] in (*FORGERIES, *STORE_FORGERIES)]
    off = [r for r in rows if not r["checked"] and r["what"] in FORGERIES]
    return {"operator_path_forgeries_accepted": sum(r["accepted"] for r in on),
            "untouched_answers_taken": sum(r["accepted"] for r in rows if r["checked"] and r["what"] in CONTROLS),
            "honest_banned_by_forgeries": sum(r["honest_banned"] for r in on),
            "unchecked_forgeries_accepted": sum(r["accepted"] for r in off),
            "unchecked_honest_banned": sum(r["honest_banned"] for r in off), "forgeries": len(on),
            "store_forgeries_accepted": sum(r["accepted"] for r in on if r["what"] in STORE_FORGERIES), "rows": rows}
