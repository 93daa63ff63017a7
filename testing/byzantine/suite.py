"""The byzantine suite against a real pool (bench/byzantine.py, suite part): a real coordinator and the real verifier
(p = 1) against every attack of `testing.byzantine.attacks`, `attempts` times each, while an honest vLLM node and an
honest torch node keep working until at least `honest_groups` honest groups were verified."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarmrl.protocol import messages as m
from swarmrl.testing.byzantine.harness import make_checkpoint


def suite(out: Path, attempts: int, honest_groups: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    from swarmrl.testing.byzantine.attacks import run_suite
    from swarmrl.testing.byzantine.harness import open_pool

    root = out / "suite"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    sampling = m.SamplingSpec(temperature=1.0, max_tokens=16, group_size=8)
    with open_pool(root, make_checkpoint(root / "ckpt"), sampling=sampling, verifier={"sample_rate": 1.0}) as pool:
        honest = [pool.node(name="honest-vllm", engine="vllm", max_prompts=8),
                  pool.node(name="honest-torch", engine="torch", max_prompts=8)]
        ids = [h.node_id for h in honest]

        def honest_round() -> int:
            for h in honest:
                h.sync()
                h.step()
            return pool.verify_all()

        def honest_total() -> int:
            return sum(1 for nid in ids for g in pool.groups(nid) if g["status"] != "pending")

        from swarmrl.testing.byzantine.attacks import ATTACKS

        done = [0]
        total = attempts * len(ATTACKS)

        def interleaved() -> int:
            """Honest work spread over the attacks, so that the honest target is reached by the last one."""
            done[0] += 1
            if honest_total() < honest_groups * done[0] / total:
                return honest_round()
            return 0

        t0 = time.time()
        honest_round()
        results = run_suite(pool, attempts, honest=interleaved)
        log(f"suite: {attempts} attempts of {len(results)} attacks in {time.time() - t0:.0f} s")
        while honest_total() < honest_groups:
            honest_round()
        for h in honest:
            h.engine.close()
        groups = [g for nid in ids for g in pool.groups(nid)]
        rejected = [g for g in groups if g["status"] == "rejected"]
        honest_reports = [pool.verifier.reports[g["id"]] for g in groups if g["id"] in pool.verifier.reports]
    summary = {
        "attacks": {k: [sum(a.detected for a in v), len(v)] for k, v in results.items()},
        "stages": {k: sorted({a.stage for a in v}) for k, v in results.items()},
        "caught_by": {k: sorted({c for a in v for c in a.caught_by}) for k, v in results.items()},
        "example_reasons": {k: v[0].reason for k, v in results.items()},
        "honest_rejected": len(rejected),
        "honest_total": len(groups),
        "honest_rejected_reasons": [g["reason"] for g in rejected][:10],
        "honest_max_logprob_diff": max(r.max_logprob_diff for r in honest_reports),
        "honest_max_replay_gap": max(r.max_replay_gap for r in honest_reports),
        "honest_proof_max_ulp": max(r.proof_max_ulp for r in honest_reports),
    }
    (out / "suite.json").write_text(json.dumps(summary, indent=1))
    return summary
