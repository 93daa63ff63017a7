"""Checks that outlast their claim (bench/byzantine.py, adaptive part; tests/test_final_draws.py).

Two verifiers work one pool whose claims last a microsecond, so every group one verifier is checking is claimable
again. Each round a cheating identity (made-up completions, annotated with the true model: only the full check's
replay catches them) submits one group and verifier A claims it. When A holds it, A's verdict lands at once. When
A's draw says full check, the check outlasts the claim: verifier B claims the group again, B's verdict lands
first and A's after it. Before draws were final, B drew afresh: its hold (probability 1 - p) landed first and A's
failed check was ignored, so a cheat was caught only when both drew a check, p squared instead of p. Now B reads
the draw A read, and a failed check bans whatever landed first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from swarmrl.protocol import messages as m
from swarmrl.testing.byzantine import nodes as bad
from swarmrl.testing.byzantine.harness import Pool, ScriptedNode
from swarmrl.verifier.service import Verifier

WAIT_S = 600.0
"""The longest a step of the race waits for the other verifier: a way out, never reached when both work."""


def second_verifier(pool: Pool) -> Verifier:
    """Another verifier of `pool`, with the first one's settings and key, and a work directory of its own."""
    cfg = pool.verifier.cfg.model_copy(update={"work_dir": pool.root / "verifier-b"})
    return Verifier(cfg, identity=pool.verifier.identity)


def race(a: Verifier, b: Verifier) -> tuple[list[int], list[int]]:
    """A claims what is pending and decides. A hold is quick: A posts it at once, and B then finds nothing to
    claim. A full check is slow: it outlasts A's claim, so B claims the group again and B's verdict lands first,
    A's after it. The group ids each claimed."""
    b_may_go, b_done = threading.Event(), threading.Event()
    claims: dict[str, list[int]] = {"a": [], "b": []}
    errors: list[BaseException] = []
    pending, post = a.client.pending, a.client.verdicts

    def a_pending(*args: Any, **kw: Any) -> list[m.PendingGroup]:
        groups = pending(*args, **kw)
        claims["a"] = [g.group_id for g in groups]
        return groups

    def a_post(verdicts: list[m.Verdict]) -> None:
        if any(v.ban or (v.accepted and v.checked) for v in verdicts):  # a full check ran: B overtakes it
            b_may_go.set()
            if not b_done.wait(WAIT_S):
                raise TimeoutError("the second verifier did not finish")
        post(verdicts)

    def run_a() -> None:
        try:
            a.poll_once()
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)
        finally:
            b_may_go.set()

    a.client.pending, a.client.verdicts = a_pending, a_post  # type: ignore[method-assign]
    thread = threading.Thread(target=run_a, name="verifier-a")
    thread.start()
    try:
        if not b_may_go.wait(WAIT_S):
            raise TimeoutError("the first verifier did not decide")
        b_pending = b.client.pending
        b.client.pending = lambda *args, **kw: _recorded(b_pending(*args, **kw), claims["b"])  # type: ignore
        try:
            b.poll_once()
        finally:
            b.client.pending = b_pending  # type: ignore[method-assign]
            b_done.set()
    finally:
        thread.join(WAIT_S)
        a.client.pending, a.client.verdicts = pending, post  # type: ignore[method-assign]
    if errors:
        raise errors[0]
    return claims["a"], claims["b"]


def _load(v: Verifier, version: int) -> None:
    """Load `version` into `v` now. Two verifiers in one process must not load a model at the same time: loading
    a checkpoint is not thread-safe (a failed load here left every later one failing, and nothing was caught).
    A verifier in production is a process of its own."""
    v.verify([])  # connects
    assert v.models is not None
    v.models.get(version)


def _recorded(groups: list[m.PendingGroup], into: list[int]) -> list[m.PendingGroup]:
    into.extend(g.group_id for g in groups)
    return groups


def run(pool: Pool, rounds: int, truth: bad.Truth, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """`rounds` cheating groups, one per round, each raced for by two verifiers. `caught_rounds` lists the rounds
    whose cheat got its identity banned; `cheat_check_rate` is their share (the rule promises p: warm-up 0, no
    cap on held groups, so only the draw decides)."""
    b = second_verifier(pool)
    for v in (pool.verifier, b):  # one after the other, before they race (below)
        _load(v, max(pool.versions))
    attacker: ScriptedNode | None = None
    caught, reclaimed, identities = [], 0, 0
    try:
        for i in range(rounds):
            if attacker is None:
                attacker = pool.node(bad.EditNode, name=f"reclaimer-{identities}", max_prompts=1,
                                     edit=bad.made_up_completion, truth=truth)
                identities += 1
            if not attacker.step():
                raise RuntimeError("the attacker got no lease")
            a_ids, b_ids = race(pool.verifier, b)
            reclaimed += len(set(a_ids) & set(b_ids))  # the groups whose full check B overtook
            if pool.node_facts(attacker.node_id)[1]:
                caught.append(i)
                attacker = None
            if (i + 1) % 50 == 0:
                log(f"re-claims: {i + 1}/{rounds} rounds, {len(caught)} caught")
    finally:
        if b.models is not None:
            b.models.close()
    return {"rounds": rounds, "caught": len(caught), "caught_rounds": caught, "reclaimed": reclaimed,
            "identities": identities, "cheat_check_rate": len(caught) / rounds if rounds else None}


def section(root: Any, ckpt: Any, p: float, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The bench's arm: `cheat_check_rate_with_reclaims` over `rounds` rounds at sample rate `p`, and its ratio
    to p (the issue asks >= 0.95)."""
    from swarmrl.testing.byzantine.harness import open_pool

    vcfg = {"warmup_checks": 0, "sample_rate": p, "max_held": 10**6}
    with open_pool(root, ckpt, verifier=vcfg, claim_ttl_s=1e-6) as pool:
        res = run(pool, rounds, bad.Truth(ckpt), log)
    rate = res["cheat_check_rate"]
    res.pop("caught_rounds")
    return {**res, "p": p, "cheat_check_rate_with_reclaims": rate,
            "cheat_check_rate_over_p": round(rate / p, 3) if rate is not None else None}
