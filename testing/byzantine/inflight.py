"""In-flight weight updates against a real pool: honest nodes whose groups span two versions, and nodes that lie
about the version of a span (tests/test_inflight_updates.py, bench/inflight_updates.py).

Each round publishes a new version (the last one perturbed) while every node holds a lease of the version before:
the node loads the new one at its first chunk boundary, so its groups span two versions. A `SpanLiar` generates as
honestly, then misreports the spans of every group before signing them:

- `hide`: no spans (one version for all of it, the oldest: what a node that did not want to say it changed
  versions mid-lease would claim);
- `late`: the change a chunk later than it was (tokens of the new version claimed as the old one's);
- `early`: the change a token earlier than it was (a token of the old version claimed as the new one's).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from swarmrl.protocol import messages as m
from swarmrl.testing.byzantine.harness import ScriptedNode, make_checkpoint, open_pool, perturb_checkpoint

SAMPLING = m.SamplingSpec(temperature=0.8, max_tokens=12, group_size=4, in_flight_updates=True, update_chunk_tokens=4)
LIES = ("hide", "late", "early")


class SpanLiar(ScriptedNode):
    """Generates honestly with in-flight updates, then misreports the version spans of every group (`LIES`)."""

    def __init__(self, cfg, lie: str, source: str | None = None):
        super().__init__(cfg, source)
        if lie not in LIES:
            raise ValueError(f"unknown lie {lie!r}; known: {LIES}")
        self.lie = lie

    def tamper(self, submission: m.RolloutSubmission, lease: m.Lease) -> m.RolloutSubmission:
        chunk = lease.sampling.update_chunk_tokens
        groups = []
        for g in submission.groups:
            spans = list(g.version_spans)
            if len(spans) == 2:
                (a, v), (b, w) = spans
                longest = max(len(r.completion_ids) for r in g.rollouts)
                spans = {"hide": [], "late": [(a, v), (b + chunk, w)] if b + chunk < longest else [],
                         "early": [(a, v), (b - 1, w)]}[self.lie]
            groups.append(g.model_copy(update={"version_spans": spans}))
        return submission.model_copy(update={"groups": groups})


def inflight_suite(out: Path, attempts: int, honest_groups: int, engines: Sequence[str] = ("torch",),
                   max_prompts: int = 8, frac: float = 0.01, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Rounds of a new version each until the honest nodes (one per engine) had at least `honest_groups` groups that
    span two versions verified, with a new liar of each lie in each of the first `attempts` rounds. Every group is
    fully checked (sample rate 1). The summary: honest groups (spanning two versions, rejected, their reasons), and
    per lie the attempts caught (rejected and banned) of those made."""
    ckpt = make_checkpoint(out / "v0")
    t0 = time.time()
    with open_pool(out, ckpt, sampling=SAMPLING, max_staleness=1, verifier={"sample_rate": 1.0}) as pool:
        honest = [pool.node(name=f"honest-{e}", engine=e, max_prompts=max_prompts) for e in engines]
        caught: dict[str, list[bool]] = {lie: [] for lie in LIES}
        reasons: dict[str, str] = {}
        spanning: set[tuple[str, str, str]] = set()
        latest = ckpt
        try:
            for n in honest:
                n.step()
            r = 0
            while r < attempts or len(spanning) < honest_groups:
                liars = [pool.node(SpanLiar, name=f"liar-{lie}-{r}", max_prompts=2, lie=lie)
                         for lie in LIES] if r < attempts else []
                for n in liars:
                    n.step()  # the version before: a lease of it in hand
                latest = perturb_checkpoint(latest, out / f"v{r + 1}", frac, seed=r + 1)
                pool.publish(latest)
                for n in [*honest, *liars]:
                    n.sync()
                    n.step()
                for n in honest:
                    spanning |= {(n.node_id, n.last_lease.lease_id, g.prompt_id)
                                 for g in n.last_submission.groups if len(g.version_spans) == 2}
                pool.verify_all()
                for n in liars:
                    rows = pool.groups(n.node_id)
                    lied = [g["reason"] for g in rows if g["status"] == "rejected"]
                    caught[n.lie].append(bool(lied) and pool.node_row(n.node_id).banned)
                    # The group that failed its check (the node's others were dropped with the ban).
                    reasons.setdefault(n.lie, next((x for x in lied if x.startswith("version")), "; ".join(lied)))
                    n.engine.close()
                r += 1
                if r % 10 == 0:
                    log(f"round {r}: {len(spanning)} honest groups spanning two versions so far "
                        f"({time.time() - t0:.0f} s)")
        finally:
            for n in honest:
                n.engine.close()
        rows = [g for n in honest for g in pool.groups(n.node_id)]
        rejected = [g["reason"] for g in rows if g["status"] == "rejected"]
        banned = sum(pool.node_row(n.node_id).banned for n in honest)
        reports = [pool.verifier.reports[g["id"]] for g in rows if g["id"] in pool.verifier.reports]
    return {
        "honest_groups": len(rows), "honest_spanning_two_versions": len(spanning), "honest_rejected": len(rejected),
        "honest_rejected_reasons": rejected[:10], "honest_nodes_banned": banned, "honest_full_checked": len(reports),
        "honest_max_logprob_diff": max((r.max_logprob_diff for r in reports), default=None),
        "lies": {lie: [sum(v), len(v)] for lie, v in caught.items()}, "example_reasons": reasons,
        "rounds": r, "engines": list(engines), "seconds": round(time.time() - t0, 1),
    }
