"""Framing honest nodes through a man in the middle (bench/byzantine.py, adaptive part; tests/test_mitm.py).

An honest node reaches a real pool through `testing.mitm.Mitm`, which rewrites the leases it is handed (a prompt,
max_tokens, the temperature). The node checks each lease's signature (`CoordinatorClient.check_lease`) and refuses
the rewritten ones; the verifier judges every group against the lease the coordinator signed, so a node that acted
on a rewritten lease would be banned. Side by side: the same honest node with the check turned off (`Unchecked`),
the baseline that shows what the signature prevents.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarmrl.protocol import messages as m
from swarmrl.runtime.client import CoordinatorError, UntrustedResponse
from swarmrl.testing.byzantine.harness import Pool, ScriptedNode, open_pool
from swarmrl.testing.mitm import Mitm, rewrite_lease

REWRITES = ("prompt", "max_tokens", "temperature")
ONE_PROXY = {"unproven_per_source": 10**6}
"""Every node reaches the pool through the one proxy, so from one address: the per-source share of newcomers
(`coordinator.admission`) would ration them as one machine."""


class Unchecked(ScriptedNode):
    """An honest node that acts on whatever lease reaches it (what nodes did before leases were signed)."""

    def prepare(self) -> Unchecked:
        super().prepare()
        self.client.check_lease = lambda lease: None  # type: ignore[method-assign]
        return self


def behind(pool: Pool, proxy: Mitm, name: str, cls: type[ScriptedNode] = ScriptedNode, **kw: Any) -> ScriptedNode:
    """An honest node of `pool` that reaches it only through `proxy`."""
    cfg = pool.node_config(name, **kw).model_copy(update={"coordinator_url": proxy.url})
    return cls(cfg).prepare()


def attempt(node: ScriptedNode) -> str:
    """One lease through the proxy: 'refused' (the node would not act on it), 'submitted', 'no work', or the
    coordinator's refusal."""
    try:
        worked = node.step()
    except UntrustedResponse:
        return "refused"
    except CoordinatorError as e:
        return f"{e.status}: {e.reason}"
    return "submitted" if worked else "no work"


def run_rewrite(pool: Pool, what: str, leases: int, checked: bool) -> dict[str, Any]:
    """`leases` leases of one honest node through a proxy that rewrites `what` in each; then the verifier decides
    everything: was the node banned?"""
    with Mitm(pool.url, rewrite_lease(what)) as proxy:
        node = behind(pool, proxy, f"{'checked' if checked else 'unchecked'}-{what}",
                      ScriptedNode if checked else Unchecked)
        outcomes = [attempt(node) for _ in range(leases)]
        rewritten = proxy.rewritten
    if node.engine is not None:
        node.engine.close()
    pool.verify_all()
    groups = pool.groups(node.node_id)
    return {"rewrite": what, "checked": checked, "leases_rewritten": rewritten, "outcomes": outcomes,
            "leases_refused": outcomes.count("refused"), "submitted": outcomes.count("submitted"),
            "groups_rejected": sum(g["status"] == "rejected" for g in groups),
            "banned": pool.node_facts(node.node_id)[1],
            "ban_reason": next((g["reason"] for g in groups if g["status"] == "rejected"), "")[:160]}


def section(root: Path, ckpt: Path, leases: int = 3, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every rewrite against a node that checks its leases and one that does not, on one pool (p = 1, so every
    group is checked). `framed_honest_nodes`: checking honest nodes banned (must be 0)."""
    sampling = m.SamplingSpec(temperature=1.0, max_tokens=16, group_size=8)
    rows = []
    with open_pool(root, ckpt, sampling=sampling, verifier={"sample_rate": 1.0}, admission=ONE_PROXY) as pool:
        for checked in (True, False):
            for what in REWRITES:
                row = run_rewrite(pool, what, leases, checked)
                log(f"framing {row}")
                rows.append(row)
    mine = [r for r in rows if r["checked"]]
    return {"framed_honest_nodes": sum(r["banned"] for r in mine),
            "framed_unchecked_nodes": sum(r["banned"] for r in rows if not r["checked"]),
            "forged_leases_refused": sum(r["leases_refused"] for r in mine),
            "forged_leases": sum(r["leases_rewritten"] for r in mine), "rows": rows}
