"""Calibration of the verifier's tolerances (bench/byzantine.py, calibration part): honest groups from the vLLM and
torch engines, and groups from weights perturbed by 0.1% and 1%, recomputed by the verifier's prefill in fp32 on the
CPU, on the random tiny (0.86M) and ~27M Llamas and on a swarm run's warm-started and RL-trained checkpoints:
distributions of max |delta logprob| per group, engine-vs-verifier logit error, replay gaps, proof errors."""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from swarmrl.node.engine import EngineConfig, GenerationRequest
from swarmrl.node.engines import build_engine
from swarmrl.testing.byzantine.garbage import pending_groups, prompts, rare_eos_checkpoint
from swarmrl.testing.byzantine.harness import make_checkpoint, perturb_checkpoint
from swarmrl.trainer.model import ModelConfig, build_tokenizer
from swarmrl.verifier.config import Tolerances
from swarmrl.verifier.full_check import Staging, full_check
from swarmrl.verifier.models import load_policy

M30 = ModelConfig(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1536, max_positions=256, seed=0)


def make_long_model(out: Path) -> Path:
    """The ~27M model, with EOS made rare so that completions run to max_tokens."""
    return rare_eos_checkpoint(out, M30)


class StateRecorder:
    """Records the hidden states engines hand to `node.proof.build_proof` (engine-vs-verifier logits)."""

    def __init__(self) -> None:
        from swarmrl.node import proof

        self.module, self.orig, self.states = proof, proof.build_proof, []

    def __enter__(self) -> StateRecorder:
        def record(states, *a, **kw):
            self.states.append(states.clone())
            return self.orig(states, *a, **kw)

        self.module.build_proof = record
        return self

    def __exit__(self, *exc: object) -> None:
        self.module.build_proof = self.orig


# -- 1. calibration ----------------------------------------------------------------------------------------------


def generate(kind: str, ckpt: Path, texts: list[str], group: int, temperature: float, max_tokens: int,
             seed: int) -> tuple[list[GenerationRequest], list, float, list[torch.Tensor]]:
    tok = build_tokenizer()
    rng = random.Random(seed)
    reqs = [GenerationRequest(tok(t).input_ids, seed=rng.getrandbits(63)) for t in texts for _ in range(group)]
    engine = build_engine(EngineConfig(kind=kind, max_model_len=256), ckpt, temperature)
    try:
        with StateRecorder() as rec:
            t0 = time.perf_counter()
            comps = engine.generate(reqs, max_tokens)
            seconds = time.perf_counter() - t0
    finally:
        engine.close()
    return reqs, comps, seconds, rec.states


def measure(kind: str, gen_ckpt: Path, policy, texts: list[str], group: int, temperature: float, max_tokens: int,
            seed: int) -> dict[str, Any]:
    """Generate with `gen_ckpt` on engine `kind`, check against `policy` (the true weights), summarise."""
    reqs, comps, gen_s, states = generate(kind, gen_ckpt, texts, group, temperature, max_tokens, seed)
    groups = pending_groups(texts, reqs, comps, group, temperature, max_tokens)
    t0 = time.perf_counter()
    reports = full_check(groups, policy, Tolerances(), staging=Staging(early_exit=False))  # every layer's figures
    check_s = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in comps)
    out: dict[str, Any] = {
        "engine": kind, "groups": len(groups), "tokens": tokens, "gen_s": round(gen_s, 2), "check_s": round(check_s, 2),
        "max_logprob_diff": _spread([r.max_logprob_diff for r in reports]),
        "replay_max_gap": _spread([r.max_replay_gap for r in reports]),
        "replay_mismatch_tokens": sum(r.replay_mismatches for r in reports),
        "proof_max_ulp": _spread([r.proof_max_ulp for r in reports]),
        "proof_mean_ulp": _spread([r.proof_mean_ulp for r in reports]),
        "failed_groups": sum(r.reason is not None for r in reports),
        "caught_by": sorted({f.split(":")[0] for r in reports for f in r.failures}),
    }
    if gen_ckpt == policy.path and states:
        from swarmrl.verifier.prefill import recompute

        seqs = [(q.prompt_ids, c.token_ids) for q, c in zip(reqs, comps, strict=True)]
        rc = recompute(policy.model, seqs, policy.pad_id)
        from swarmrl.models.head import head_of

        head = head_of(policy.model)
        with torch.no_grad():
            dlogit = max(float((head(s) - r.logits).abs().max()) for s, r in zip(states, rc, strict=True))
            from swarmrl.protocol import sampling

            gaps_t = torch.cat([sampling.decision_margins(r.logits, torch.full((len(c.token_ids),), q.seed),
                                                          torch.arange(len(c.token_ids)), temperature)
                                for q, c, r in zip(reqs, comps, rc, strict=True)])
        rel = 0.0
        for st, r in zip(states, rc, strict=True):
            idx = r.states.abs().topk(4, dim=-1).indices
            mine = r.states.gather(-1, idx)
            rel = max(rel, float(((st.gather(-1, idx) - mine).abs() / mine.abs()).max()))
        out["state_rel_err_topk_max"] = rel
        out["logit_err_max"] = dlogit
        out["top2_gap_min"] = float(gaps_t.min())
        out["tokens_with_top2_gap_below_1e-4"] = int((gaps_t < 1e-4).sum())
        out["tokens_with_top2_gap_below_1e-3"] = int((gaps_t < 1e-3).sum())
    return out


def _spread(xs: list[float]) -> list[float]:
    """[min, median, max] of per-group values."""
    return [float(f"{min(xs):.3g}"), float(f"{statistics.median(xs):.3g}"), float(f"{max(xs):.3g}")]


def calibrate(out: Path, quick: bool, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Random tiny and 27M models, and (after the swarm part) the warm-started and the RL-trained checkpoints
    of the swarm run, whose larger logits make fp32 noise larger (the tolerances must cover them)."""
    rows = []
    setups = [("tiny", make_checkpoint(out / "tiny"), 64 if not quick else 16, 24, 1.0),
              ("27M", make_long_model(out / "m27"), 8 if not quick else 2, 128, 1.0)]
    trained = sorted((out / "swarm" / "eval").glob("v*"))
    if (out / "swarm" / "init" / "config.json").exists():
        setups.append(("warm", out / "swarm" / "init", 64 if not quick else 16, 6, 1.0))
    if trained:
        setups.append((f"rl-trained-{trained[-1].name}", trained[-1], 64 if not quick else 16, 6, 1.0))
    for name, ckpt, n_prompts, max_tokens, temperature in setups:
        policy = load_policy(ckpt, 0)
        texts = prompts(n_prompts, seed=len(name))  # fixed per model (str hashes vary between processes)
        variants = [("honest", "vllm", ckpt), ("honest", "torch", ckpt)]
        for frac in (0.001, 0.01):
            variants.append((f"perturbed {frac:g}", "vllm", perturb_checkpoint(ckpt, out / f"{name}-p{frac:g}", frac)))
        for label, kind, gen_ckpt in variants:
            row = {"model": name, "weights": label, **measure(kind, gen_ckpt, policy, texts, 8, temperature,
                                                                max_tokens, seed=7)}
            log(f"calibration {json.dumps(row)}")
            rows.append(row)
    (out / "calibration.json").write_text(json.dumps(rows, indent=1))
    return {"rows": rows}
