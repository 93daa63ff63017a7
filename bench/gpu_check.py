"""GPU check: the torch engine and the verifier in bf16 on CUDA, on honest groups of every architecture; the errors
seen (the verifier's bf16 tolerances are estimates until this runs); the sampler on the GPU at a 152k vocabulary.

Parts:
1. honest groups: for each architecture (llama, qwen2, qwen3) and size (small30m, and "qwen05b": Qwen2.5-0.5B's
   shape with a 151936-row vocabulary), the torch engine samples groups at T = 0.7 and 1.0 in `--dtype` and the
   verifier recomputes them (`swarmrl.testing.local.verify_groups`, cheap + full check) in the same dtype, and
   in float32 as a reference, both judged with the engine dtype's current tolerances
   (`verifier.config.Tolerances.for_dtype`). Reported per setup: max |logprob - recomputed|, replay mismatches
   and the largest score gap among them, the smallest top-2 gap, the relative difference of top-k state entries,
   proof errors (max / mean fp16 ulp), and the groups rejected. `suggested` sizes tolerances from the worst
   values seen (5x margins; 3x for the boundary), for bench/RESULTS.md and `BF16_ESTIMATES`.
2. noise across devices: `protocol.sampling.gumbel_noise` on the CPU and on the GPU for the same (seed, position,
   token): elements that differ and the largest difference (the float64 logs may differ in the last bit); and the
   GPU's sampled tokens against the CPU's samples of the same logits.
3. sampler speed on the GPU: `sample_with_logprobs` on [64 x 151936] float32 logits against plain sampling as
   vLLM does it (softmax, exponential race, log_softmax for the logprob), ms per step; and that no op makes a
   CPU tensor of the vocabulary's size (the noise is built on the GPU).

On the GPU machine (no network there): carry the wheels this project needs beyond its image, from the repository
root here (`.whl/` is git-ignored):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2 \\
        typing-extensions==4.15.0 cryptography==46.0.3 cffi==2.0.0 pycparser==2.23

then run (device tool, carry [".whl"], timeout 600):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && \\
        python3 bench/gpu_check.py --out $OUT 2>&1 | tee $OUT/gpu_check.log

Here, on the CPU (a small version, to check the script): `python bench/gpu_check.py --device cpu --sizes mini
--groups 2 --max-tokens 16 --skip-speed`.

The last line printed is one JSON object (also written to <out>/gpu_check.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, when not installed

import torch  # noqa: E402

from swarmrl.models.build import ModelConfig, build_model, save_checkpoint  # noqa: E402
from swarmrl.models.tokenizers import build_bpe_tokenizer  # noqa: E402
from swarmrl.node.engine import EngineConfig  # noqa: E402
from swarmrl.node.engines import build_engine  # noqa: E402
from swarmrl.protocol import sampling  # noqa: E402
from swarmrl.testing.local import group_requests, pending_groups, verify_groups  # noqa: E402
from swarmrl.verifier.config import Tolerances  # noqa: E402
from swarmrl.verifier.models import load_policy  # noqa: E402
from swarmrl.verifier.prefill import recompute  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {
    "mini": {"preset": "mini", "bpe": 2048},
    "small30m": {"preset": "small30m", "bpe": 8192},
    # Qwen2.5-0.5B's shape (heads of 64, 2 kv heads) and vocabulary rows; 494M parameters, bf16 weights.
    "qwen05b": {"preset": "small30m", "bpe": 8192, "hidden_size": 896, "num_layers": 24, "num_heads": 14,
                "num_kv_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_embeddings": True},
}
PROMPTS = ("{a}+{b}=", "What is {a} plus {b}?", "Write a story about the number {a}.")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_checkpoint(root: Path, arch: str, size: str) -> Path:
    out = root / f"{arch}-{size}"
    if (out / "config.json").exists():
        return out
    spec = dict(SIZES[size])
    preset, bpe = spec.pop("preset"), spec.pop("bpe")
    tok = build_bpe_tokenizer(bpe)
    model = build_model(ModelConfig.preset(preset, arch=arch, **spec), tok)
    if size == "qwen05b":
        model = model.to(torch.bfloat16)  # half the bytes to write and read; every dtype below loads from these
    return save_checkpoint(model, tok, out)


class StateRecorder:
    """Keeps the final hidden states the engine hands to `node.proof.build_proofs` (one [n, hidden] per rollout)."""

    def __init__(self) -> None:
        from swarmrl.node import proof

        self.module, self.orig, self.states = proof, proof.build_proofs, []

    def __enter__(self) -> StateRecorder:
        def record(states, *a, **kw):
            self.states.extend(s.detach().float().cpu().clone() for s in states)
            return self.orig(states, *a, **kw)

        self.module.build_proofs = record
        return self

    def __exit__(self, *exc: object) -> None:
        self.module.build_proofs = self.orig


@torch.no_grad()
def state_rel_error(policy, groups, states: list[torch.Tensor], topk: int = 4) -> float:
    """Largest relative difference between the engine's and the verifier's values at the verifier's top-(k+1)
    entries of each state: a proof entry must be this far inside the top-k for both to select it, which is what
    `proof_boundary_rel` must cover."""
    seqs = [(g.group.prompt_ids, r.completion_ids) for g in groups for r in g.group.rollouts]
    worst = 0.0
    for rc, mine in zip(recompute(policy.model, seqs, policy.pad_id), states, strict=True):
        idx = rc.states.abs().topk(topk + 1, dim=-1).indices
        ref = rc.states.gather(-1, idx)
        worst = max(worst, float(((mine.gather(-1, idx) - ref).abs() / ref.abs()).max()))
    return worst


@torch.no_grad()
def top2_gaps(policy, groups) -> float:
    """The smallest decision margin (`protocol.sampling.decision_margins`) of the verifier's logits over every
    token (how close honest sampling comes to ties: the tie margin must cover the logit error there)."""
    smallest = float("inf")
    seqs = [(g.group.prompt_ids, r.completion_ids) for g in groups for r in g.group.rollouts]
    meta = [(r.seed, g.sampling.temperature) for g in groups for r in g.group.rollouts]
    for rc, (seed, temperature) in zip(recompute(policy.model, seqs, policy.pad_id), meta, strict=True):
        n = rc.logits.shape[0]
        margins = sampling.decision_margins(rc.logits, torch.full((n,), seed), torch.arange(n), temperature)
        smallest = min(smallest, float(margins.min()))
    return smallest


def honest_part(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for size in args.sizes:
        for arch in args.archs:
            ckpt = make_checkpoint(root, arch, size)
            policies = {dt: load_policy(ckpt, 0, getattr(torch, dt), args.device)
                        for dt in dict.fromkeys([args.dtype, "float32"])}
            engine = build_engine(EngineConfig(kind="torch", dtype=args.dtype, device=args.device,
                                               torch_batch_size=args.batch), ckpt, temperature=1.0)
            try:
                for temperature in (0.7, 1.0):
                    rng = random.Random(f"{arch}/{size}/{temperature}")
                    texts = [rng.choice(PROMPTS).format(a=rng.randint(0, 999), b=rng.randint(0, 999))
                             for _ in range(args.groups)]
                    reqs = group_requests(policies[args.dtype].tokenizer, texts, args.group_size, temperature, rng)
                    t0 = time.perf_counter()
                    with StateRecorder() as recorder:
                        comps = engine.generate(reqs, args.max_tokens)
                    gen_s = time.perf_counter() - t0
                    groups = pending_groups(texts, reqs, comps, args.group_size, args.max_tokens)
                    for dt, policy in policies.items():
                        t0 = time.perf_counter()
                        reasons, reports = [], []
                        for start in range(0, len(groups), args.verify_chunk):  # bounds the verifier's memory
                            # The nodes' dtype sets the tolerances, whatever the verifier computes in.
                            got = verify_groups(policy, groups[start:start + args.verify_chunk],
                                                Tolerances.for_dtype(args.dtype))
                            reasons += got[0]
                            reports += got[1]
                        check_s = time.perf_counter() - t0
                        full = [r for r in reports if r is not None]
                        name = f"{arch}/{size}@{temperature:g} engine {args.dtype}, verifier {dt}"
                        rows[name] = {
                            "rejected": sum(r is not None for r in reasons), "groups": len(groups),
                            "tokens": sum(len(c.token_ids) for c in comps),
                            "max_logprob_diff": max((r.max_logprob_diff for r in full), default=None),
                            "replay_mismatches": sum(r.replay_mismatches for r in full),
                            "max_replay_gap": max((r.max_replay_gap for r in full), default=None),
                            "min_top2_gap": top2_gaps(policy, groups),
                            "state_rel_err_topk_max": state_rel_error(policy, groups, recorder.states),
                            "proof_max_ulp": max((r.proof_max_ulp for r in full), default=None),
                            "proof_mean_ulp": max((r.proof_mean_ulp for r in full), default=None),
                            "reasons": sorted({(r or "").split(":")[0] for r in reasons if r}),
                            "gen_s": round(gen_s, 2), "check_s": round(check_s, 2)}
                        log(f"{name}: {json.dumps(rows[name])}")
            finally:
                engine.close()
            del policies
            if args.device == "cuda":
                torch.cuda.empty_cache()
    seen = [r for k, r in rows.items() if k.endswith(f"verifier {args.dtype}") and r["max_logprob_diff"] is not None]
    suggested = {}
    if seen:
        suggested = {"logprob_abs": 5 * max(r["max_logprob_diff"] for r in seen),
                     "proof_max_ulp": 5 * max(r["proof_max_ulp"] for r in seen),
                     "proof_mean_ulp": 5 * max(r["proof_mean_ulp"] for r in seen),
                     "proof_boundary_rel": 3 * max(r["state_rel_err_topk_max"] for r in seen),
                     "tie_margin_covers_replay_gap": max(r["max_replay_gap"] for r in seen)}
    return {"honest": rows, "tolerances_now": Tolerances.for_dtype(args.dtype).model_dump(),
            "suggested": suggested}


def noise_part(args: argparse.Namespace) -> dict[str, Any]:
    vocab, rows = 151936, 64
    seeds = torch.arange(rows, dtype=torch.int64) * 7919 + 3
    positions = torch.arange(rows, dtype=torch.int64) % 17
    cpu = sampling.gumbel_noise(seeds, positions, vocab)
    dev = sampling.gumbel_noise(seeds.to(args.device), positions.to(args.device), vocab).cpu()
    differ = cpu != dev
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    tokens, _ = sampling.sample_with_logprobs(logits.to(args.device), seeds, positions, 0.7)
    want, _ = sampling.sample_with_logprobs(logits, seeds, positions, 0.7)
    out = {"noise_elements": cpu.numel(), "noise_elements_differing": int(differ.sum()),
           "noise_max_abs_diff": float((cpu - dev).abs().max()),
           "tokens_equal_to_cpu_sample": int((tokens.cpu() == want).sum()), "tokens": rows}
    log(f"noise, cpu vs {args.device}: {json.dumps(out)}")
    return {"noise_across_devices": out}


def speed_part(args: argparse.Namespace) -> dict[str, Any]:
    from torch.utils._python_dispatch import TorchDispatchMode

    vocab, rows, temperature = 151936, 64, 0.7
    logits = torch.randn(rows, vocab, device=args.device) * 3
    seeds, positions = torch.arange(rows, device=args.device), torch.zeros(rows, dtype=torch.long, device=args.device)

    def replayable():
        return sampling.sample_with_logprobs(logits, seeds, positions, temperature)

    def plain():  # vLLM's random sampler: probabilities / Exp(1) noise, argmax; logprob from log_softmax
        probs = torch.softmax(logits / temperature, dim=-1)
        token = probs.div_(torch.empty_like(probs).exponential_()).argmax(-1)
        return token, torch.log_softmax(logits / temperature, dim=-1).gather(-1, token[:, None])

    def time_ms(fn, n: int = 50) -> float:
        for _ in range(5):
            fn()
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3

    class LargeCpu(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            r = func(*a, **(kw or {}))
            for t in r if isinstance(r, tuple | list) else (r,):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() >= vocab:
                    self.seen.append(str(func))
            return r

    with LargeCpu() as mode:
        replayable()
    out = {"replayable_ms": round(time_ms(replayable), 3), "plain_ms": round(time_ms(plain), 3),
           "rows": rows, "vocab": vocab, "large_cpu_ops": sorted(set(mode.seen)) if args.device != "cpu" else "n/a"}
    log(f"sampler on {args.device}: {json.dumps(out)}")
    return {"sampler_speed": out}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--archs", nargs="+", default=["llama", "qwen2", "qwen3"])
    p.add_argument("--sizes", nargs="+", default=["small30m", "qwen05b"], choices=sorted(SIZES))
    p.add_argument("--groups", type=int, default=6, help="groups per arch, size and temperature")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=128, help="torch engine: requests decoded together")
    p.add_argument("--verify-chunk", type=int, default=2, help="groups per verifier call (its scores are float64 "
                   "[tokens x vocab] on the CPU: 1.2 GB per group of 8 x 128 tokens at vocab 152k)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "runs/gpu-check"))
    p.add_argument("--work", type=Path, default=Path("/tmp/swarmrl-gpu-check"), help="checkpoints are built here")
    p.add_argument("--skip-speed", action="store_true")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: pass --device cpu to try the script here")
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    import transformers

    env["transformers"] = transformers.__version__
    log(f"gpu_check on {env}")
    result: dict[str, Any] = {"env": env, "dtype": args.dtype, "command": " ".join(sys.argv)}
    t0 = time.time()
    result |= noise_part(args)
    if not args.skip_speed:
        result |= speed_part(args)
    result |= honest_part(args, args.work)
    result["wall_s"] = round(time.time() - t0, 1)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
