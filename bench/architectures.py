"""Benchmark: honest nodes of every architecture and temperature through the real verifier, the replayable
sampler's cost at a 152k vocabulary against plain vLLM sampling, and the verifier's cost at 256-token completions.

Three parts (each can be skipped):

1. archs: random "mini" models of every architecture `swarmrl model` builds (Llama, Qwen2, Qwen3, Mistral, Phi3,
   Gemma2 tied with softcapping and logits spread 4, GPT-2, OPT) with a byte-level BPE, ChatML prompts and two
   stop tokens; honest groups from the vLLM engine and the torch engine at T = 0.7 and 1.0 go through the
   verifier's cheap checks and full check (`swarmrl.testing.local.verify_groups`), fp32 on the CPU. `archs`
   counts [rejected, total] groups per arch@T over both engines, `arch_max_dlogprob` the largest |claimed -
   recomputed| logprob per architecture;
2. sampler: node tokens/s of the vLLM engine with the replayable sampler (proofs off, to time the sampler alone)
   against plain vLLM sampling (temperature T, logprobs=0, unseeded) in the same engine on the same prompts, with a
   Qwen2 of vocabulary 152064 (the small30m body; an 8192-token BPE, rows beyond it are padding as in Qwen's
   checkpoints); runs alternate, the median of each is taken. `sampler_overhead` = replayable / plain tokens/s;
3. verify: the vLLM engine (proofs on) generates groups of 256-token completions with a ~30M Qwen2, and the
   verifier checks them (cheap + full, a few groups per call to bound memory); `verify_cost_ratio_256` = verifier
   seconds per token / generation seconds per token.

    python bench/architectures.py                                   # the record (see bench/RESULTS.md)
    python bench/architectures.py --groups 64 --sampler-runs 1 --verify-groups 4     # a quick check

Writes <out>/architectures.json; the last line printed is one JSON object with `archs` (arch@T -> [rejected,
total]), `sampler_overhead` and `verify_cost_ratio_256`, and the details of each part.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from swarmrl.models.build import ARCHS, ModelConfig, build_model, save_checkpoint  # noqa: E402
from swarmrl.models.tokenizers import build_bpe_tokenizer  # noqa: E402
from swarmrl.node.engine import EngineConfig  # noqa: E402
from swarmrl.node.engines import build_engine  # noqa: E402
from swarmrl.testing.local import group_requests, pending_groups, verify_groups  # noqa: E402
from swarmrl.verifier.models import load_policy  # noqa: E402

PROMPT_KINDS = ("{a}+{b}=", "What is {a} plus {b}?", "Write a sentence about the number {a}.")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prompts(n: int, rng: random.Random) -> list[str]:
    return [rng.choice(PROMPT_KINDS).format(a=rng.randint(0, 999), b=rng.randint(0, 999)) for _ in range(n)]


def checkpoint(out: Path, cfg: ModelConfig, bpe_vocab: int) -> Path:
    if not (out / "config.json").exists():
        tok = build_bpe_tokenizer(bpe_vocab)
        save_checkpoint(build_model(cfg, tok), tok, out)
    return out


# -- 1. every architecture and temperature through the verifier ---------------------------------------------------


def arch_part(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    counts: dict[str, list[int]] = {}
    by_engine: dict[str, list[int]] = {}
    details: dict[str, Any] = {}
    for arch in args.archs:
        # A tied architecture keeps its tied head (a stop rate unties it): its completions run to max_tokens.
        stop_rate = None if arch in args.tied else args.stop_rate
        ckpt = checkpoint(out / f"arch-{arch}", ModelConfig.preset("mini", arch=arch, stop_rate=stop_rate),
                          args.bpe_vocab)
        policy = load_policy(ckpt, 0)
        for kind in args.engines:
            engine = build_engine(EngineConfig(kind=kind), ckpt, temperature=1.0)
            try:
                for temperature in args.temperatures:
                    name = f"{arch}@{temperature:g}"
                    rng = random.Random(f"{arch}/{kind}/{temperature}")
                    stats = {"rejected": 0, "groups": 0, "tokens": 0, "gen_s": 0.0, "check_s": 0.0,
                             "max_logprob_diff": 0.0, "max_replay_gap": 0.0, "replay_mismatches": 0,
                             "proof_max_ulp": 0.0, "stop": 0, "length": 0, "reasons": []}
                    for start in range(0, args.groups, args.chunk):
                        texts = prompts(min(args.chunk, args.groups - start), rng)
                        reqs = group_requests(policy.tokenizer, texts, args.group_size, temperature, rng)
                        t0 = time.perf_counter()
                        comps = engine.generate(reqs, args.max_tokens)
                        stats["gen_s"] += time.perf_counter() - t0
                        groups = pending_groups(texts, reqs, comps, args.group_size, args.max_tokens, start + 1)
                        t0 = time.perf_counter()
                        reasons, reports = verify_groups(policy, groups)
                        stats["check_s"] += time.perf_counter() - t0
                        stats["groups"] += len(groups)
                        stats["rejected"] += sum(r is not None for r in reasons)
                        stats["reasons"] += [r for r in reasons if r is not None][:3]
                        stats["tokens"] += sum(len(c.token_ids) for c in comps)
                        for c in comps:
                            stats[c.finish_reason] += 1
                        for rep in reports:
                            if rep is not None:
                                stats["max_logprob_diff"] = max(stats["max_logprob_diff"], rep.max_logprob_diff)
                                stats["max_replay_gap"] = max(stats["max_replay_gap"], rep.max_replay_gap)
                                stats["replay_mismatches"] += rep.replay_mismatches
                                stats["proof_max_ulp"] = max(stats["proof_max_ulp"], rep.proof_max_ulp)
                    log(f"archs: {name} {kind}: {stats['rejected']}/{stats['groups']} rejected, "
                        f"{stats['tokens']} tokens ({stats['stop']} stopped, {stats['length']} at length), max "
                        f"|dlogprob| {stats['max_logprob_diff']:.2g}, gen {stats['gen_s']:.1f} s, check "
                        f"{stats['check_s']:.1f} s")
                    details[f"{name}/{kind}"] = {k: round(v, 9) if isinstance(v, float) else v
                                                 for k, v in stats.items()}
                    for table, key in ((counts, name), (by_engine, f"{name}/{kind}")):
                        row = table.setdefault(key, [0, 0])
                        row[0] += stats["rejected"]
                        row[1] += stats["groups"]
            finally:
                engine.close()
    worst: dict[str, float] = {}
    for key, d in details.items():
        arch = key.split("@")[0]
        worst[arch] = max(worst.get(arch, 0.0), d["max_logprob_diff"])
    return {"archs": counts, "archs_by_engine": by_engine, "arch_max_dlogprob": worst, "arch_details": details}


# -- 2. the sampler at a 152k vocabulary ----------------------------------------------------------------------------


def sampler_part(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt

    cfg = ModelConfig.preset(args.sampler_size, arch="qwen2", vocab_size=args.sampler_vocab)
    ckpt = checkpoint(out / f"sampler-{args.sampler_size}-{args.sampler_vocab}", cfg, 8192)
    engine = build_engine(EngineConfig(kind="vllm", proofs=False, max_num_seqs=args.sampler_batch), ckpt,
                          temperature=args.sampler_temperature)
    try:
        rng = random.Random(0)
        from swarmrl.models.prompts import load_tokenizer

        reqs = group_requests(load_tokenizer(ckpt), prompts(args.sampler_batch, rng), 1, args.sampler_temperature,
                              rng)
        plain_params = SamplingParams(temperature=args.sampler_temperature, max_tokens=args.sampler_tokens,
                                      logprobs=0, detokenize=False, stop_token_ids=sorted(engine.stop_ids))
        plain_prompts = [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in reqs]

        def replayable() -> int:
            return sum(len(c.token_ids) for c in engine.generate(reqs, args.sampler_tokens))

        def plain() -> int:
            outs = engine.llm.generate(plain_prompts, [plain_params] * len(plain_prompts), use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        rates: dict[str, list[float]] = {"replayable": [], "plain": []}
        replayable(), plain()  # warm-up of both paths
        for _ in range(args.sampler_runs):
            for name, fn in (("replayable", replayable), ("plain", plain)):
                t0 = time.perf_counter()
                tokens = fn()
                rates[name].append(tokens / (time.perf_counter() - t0))
        med = {k: statistics.median(v) for k, v in rates.items()}
        log(f"sampler: vocab {args.sampler_vocab}, batch {args.sampler_batch}: replayable {med['replayable']:.0f} "
            f"tokens/s, plain vLLM {med['plain']:.0f} tokens/s")
        return {"sampler_overhead": round(med["replayable"] / med["plain"], 4),
                "sampler_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
                "sampler_setup": {"vocab": args.sampler_vocab, "size": args.sampler_size, "batch": args.sampler_batch,
                                  "tokens": args.sampler_tokens, "temperature": args.sampler_temperature}}
    finally:
        engine.close()


# -- 3. the verifier's cost at 256-token completions --------------------------------------------------------------


def verify_part(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cfg = ModelConfig.preset("small30m", arch="qwen2", stop_rate=1e-4)
    ckpt = checkpoint(out / "verify-small30m", cfg, 8192)
    policy = load_policy(ckpt, 0)
    rng = random.Random(1)
    texts = prompts(args.verify_groups, rng)
    reqs = group_requests(policy.tokenizer, texts, args.group_size, 1.0, rng)
    engine = build_engine(EngineConfig(kind="vllm"), ckpt, temperature=1.0)
    try:
        t0 = time.perf_counter()
        comps = engine.generate(reqs, 256)
        gen_s = time.perf_counter() - t0
    finally:
        engine.close()
    groups = pending_groups(texts, reqs, comps, args.group_size, 256)
    t0 = time.perf_counter()
    reasons: list[str | None] = []
    for start in range(0, len(groups), args.verify_chunk):
        reasons += verify_groups(policy, groups[start:start + args.verify_chunk])[0]
    check_s = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in comps)
    log(f"verify: {tokens} tokens ({len(groups)} groups x {args.group_size} x 256): generation {gen_s:.1f} s, "
        f"verifier {check_s:.1f} s, {sum(r is not None for r in reasons)} rejected")
    return {"verify_cost_ratio_256": round(check_s / gen_s, 4),
            "verify_setup": {"tokens": tokens, "gen_s": round(gen_s, 2), "check_s": round(check_s, 2),
                             "rejected": sum(r is not None for r in reasons), "groups": len(groups),
                             "params": "small30m qwen2, BPE 8192, fp32 CPU"}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench-architectures"))
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    p.add_argument("--tied", nargs="*", default=["gemma2"], help="archs built tied, without a stop rate")
    p.add_argument("--engines", nargs="+", default=["vllm", "torch"], choices=["vllm", "torch"])
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.7, 1.0])
    p.add_argument("--groups", type=int, default=500, help="groups per arch, temperature and engine")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--chunk", type=int, default=64, help="groups per generate call")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--stop-rate", type=float, default=0.03, help="the arch models' stop-token rate per token")
    p.add_argument("--bpe-vocab", type=int, default=2048)
    p.add_argument("--sampler-size", default="small30m")
    p.add_argument("--sampler-vocab", type=int, default=152064)
    p.add_argument("--sampler-batch", type=int, default=64)
    p.add_argument("--sampler-tokens", type=int, default=64)
    p.add_argument("--sampler-temperature", type=float, default=0.7)
    p.add_argument("--sampler-runs", type=int, default=3)
    p.add_argument("--verify-groups", type=int, default=16)
    p.add_argument("--verify-chunk", type=int, default=2, help="groups per verifier call (bounds its memory)")
    p.add_argument("--skip", nargs="*", default=[], choices=["archs", "sampler", "verify"])
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
                              "cpu_threads": torch.get_num_threads()}
    t0 = time.time()
    if "archs" not in args.skip:
        result |= arch_part(args, args.out)
    if "sampler" not in args.skip:
        result |= sampler_part(args, args.out)
    if "verify" not in args.skip:
        result |= verify_part(args, args.out)
    result["wall_s"] = round(time.time() - t0, 1)
    (args.out / "architectures.json").write_text(json.dumps(result, indent=1))
    summary = {k: result[k] for k in ("archs", "arch_max_dlogprob", "sampler_overhead", "verify_cost_ratio_256")
               if k in result}
    print(json.dumps(summary | {k: v for k, v in result.items() if k not in summary and k != "arch_details"}))
    return result


if __name__ == "__main__":
    main()
