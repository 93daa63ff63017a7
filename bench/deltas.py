"""Delta checkpoints on real training traces: what a version costs to send as a delta, against the full checkpoint.

Two traces, each of `--steps` versions made by the trainer's own code: the torch engine (the node's) samples groups
of the addition task, the trainer's GRPO step (`trainer.grpo`: AdamW, clipped ratios, zero-advantage groups
skipped) updates fp32 master weights, and every version is saved as the trainer saves it (`save_checkpoint`):

- demo: the demo's model (the 0.86M Llama, warm-started like the demo's) at the demo's learning rate;
- big: the `small30m` preset with 9 layers (32.5M parameters, BPE tokenizer, no warm start) at lr 1e-6, the gpu-gsm8k
  recipe's rate. A cold model earns no task reward, so its groups are scored by the share of digits in the
  completion (the addition task's format), which differs within every group: every step is a real update.

Every version is published as the publisher publishes it (`trainer.publisher.published_weights`) in float32 and
in bfloat16, encoded against the version before (`transfer.delta.encode`), applied (`apply`) and compared bit for
bit. Per trace and dtype: delta bytes / full bytes (median, p90), the share of elements changed, encode and apply
seconds per GB of checkpoint, and a plain XOR + zstd of the whole file for comparison (no planes, no positions).

With `--broadcast` (root, `ip`, `tc`), bench/broadcast.py then times N nodes going from v to v+1 at 100 Mbit/s as
a delta with the big bf16 trace's median share of changed elements, against the full checkpoint.

    .venv/bin/python bench/deltas.py --steps 20 [--broadcast]

The last output line is one JSON object: delta_ratio_bf16_lr1e-6, delta_ratio_fp32_demo, apply_s_per_gb,
bit_identical, broadcast_delta_vs_full (null without --broadcast), and the details.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402

DTYPES = ("float32", "bfloat16")


def digit_share(text: str, answer: str) -> float:
    """The big trace's reward: the share of the completion's characters that are digits."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def trace(name: str, ckpt: Path, work: Path, lr: float, steps: int, prompts: int, group: int, max_tokens: int,
          task_reward: bool, seed: int) -> dict[str, Any]:
    """Train `steps` versions from `ckpt`, publishing each in both dtypes; the per-step measurements."""
    from swarmrl.models.build import load_checkpoint, save_checkpoint
    from swarmrl.models.prompts import pad_token_id, render_prompt
    from swarmrl.node.engine import EngineConfig, GenerationRequest
    from swarmrl.node.torch_engine import TorchEngine
    from swarmrl.protocol.tasks import TaskSpec, load_task
    from swarmrl.testing.groups import training_group
    from swarmrl.trainer.grpo import GRPOConfig, build_batch, filter_groups, grpo_step, make_optimizer
    from swarmrl.trainer.publisher import published_weights
    from swarmrl.transfer import delta

    task = load_task(TaskSpec())
    model, tok = load_checkpoint(ckpt)
    optimizer = make_optimizer(model, lr)
    engine = TorchEngine(EngineConfig(kind="torch", torch_batch_size=64), temperature=1.0)
    engine.load(ckpt)
    rng = random.Random(seed)
    reward = task.reward if task_reward else digit_share
    prev = {d: published_weights(ckpt, d)["model.safetensors"] for d in DTYPES}
    rows: dict[str, list[dict[str, float]]] = {d: [] for d in DTYPES}
    version, tries, skipped = 0, 0, 0
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{name}] {n_params / 1e6:.2f}M parameters, lr {lr:g}, {steps} versions", flush=True)
    while version < steps:
        tries += 1
        if tries > 5 * steps:
            raise RuntimeError(f"{name}: only {version} informative steps in {tries} tries")
        problems = [task.sample(rng) for _ in range(prompts)]
        reqs = [GenerationRequest(render_prompt(tok, p.prompt), seed=rng.getrandbits(63))
                for p in problems for _ in range(group)]
        comps = engine.generate(reqs, max_tokens)
        groups = []
        for i, p in enumerate(problems):
            cs = comps[i * group:(i + 1) * group]
            texts = [tok.decode(c.token_ids, skip_special_tokens=True) for c in cs]
            groups.append(training_group(group_id=i, policy_version=version, prompt_ids=reqs[i * group].prompt_ids,
                                         completions=[c.token_ids for c in cs], logprobs=[c.logprobs for c in cs],
                                         rewards=[reward(t, p.answer) for t in texts],
                                         finish_reasons=[c.finish_reason for c in cs]))
        keep, _ = filter_groups(groups)
        if not keep:
            skipped += 1
            continue
        grpo_step(model, optimizer, build_batch(keep, pad_token_id(tok)), GRPOConfig(), temperature=1.0)
        version += 1
        out = work / f"{name}-v{version:03d}"
        save_checkpoint(model, tok, out)
        engine.load(out)
        for d in DTYPES:
            target = published_weights(out, d)["model.safetensors"]
            t0 = time.perf_counter()
            payload = delta.encode(prev[d], target)
            t1 = time.perf_counter()
            rebuilt = delta.apply(prev[d], payload, len(target))
            t2 = time.perf_counter()
            a, b = np.frombuffer(prev[d], np.uint8), np.frombuffer(target, np.uint8)
            plain = len(zstandard.ZstdCompressor(level=delta.DEFAULT_LEVEL).compress((a ^ b).tobytes())) \
                if len(a) == len(b) else len(target)
            item = 4 if d == "float32" else 2
            start, _ = delta.read_tensors(target)
            changed = np.count_nonzero((a[start:] ^ b[start:]).view(np.uint32 if item == 4 else np.uint16)) \
                / ((len(b) - start) // item)
            rows[d].append({"ratio": len(payload) / len(target), "plain_ratio": plain / len(target),
                            "changed": changed, "encode_s_per_gb": (t1 - t0) / len(target) * 1e9,
                            "apply_s_per_gb": (t2 - t1) / len(target) * 1e9, "identical": rebuilt == target,
                            "full_bytes": len(target), "delta_bytes": len(payload)})
            prev[d] = target
        shutil.rmtree(work / f"{name}-v{version - 2:03d}", ignore_errors=True)
        last = {d: rows[d][-1] for d in DTYPES}
        print(f"[{name}] v{version}: fp32 {last['float32']['ratio']:.4f}, bf16 {last['bfloat16']['ratio']:.5f} "
              f"(changed {last['bfloat16']['changed']:.4f})", flush=True)
    engine.close()
    task.close()
    return {"parameters": n_params, "lr": lr, "versions": version, "skipped_batches": skipped,
            **{d: summarise(rows[d]) for d in DTYPES}}


def summarise(rows: list[dict[str, float]]) -> dict[str, Any]:
    ratios = sorted(r["ratio"] for r in rows)
    return {"ratio_median": statistics.median(ratios), "ratio_p90": float(np.percentile(ratios, 90)),
            "plain_ratio_median": statistics.median(r["plain_ratio"] for r in rows),
            "changed_median": statistics.median(r["changed"] for r in rows),
            "encode_s_per_gb": statistics.median(r["encode_s_per_gb"] for r in rows),
            "apply_s_per_gb": statistics.median(r["apply_s_per_gb"] for r in rows),
            "bit_identical": all(r["identical"] for r in rows), "full_mb": rows[0]["full_bytes"] / 1e6,
            "ratios": [round(r, 6) for r in ratios]}


def broadcast(changed: float, size_mb: float, nodes: int) -> dict[str, Any] | None:
    """bench/broadcast.py's delta mode with `changed` of the bf16 elements changed; its last JSON line."""
    cmd = [sys.executable, str(ROOT / "bench" / "broadcast.py"), "--nodes", str(nodes), "--rate-mbit", "100",
           "--size-mb", str(size_mb), "--delta-changed", f"{changed:.6f}", "--skip-origin-only"]
    print("running", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    sys.stdout.write(proc.stdout[-3000:])
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="versions per trace")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="rollouts per prompt")
    ap.add_argument("--demo-lr", type=float, default=3e-4, help="the demo's learning rate (DemoConfig.lr)")
    ap.add_argument("--big-lr", type=float, default=1e-6)
    ap.add_argument("--big-size", default="small30m", help="models.build preset of the big trace")
    ap.add_argument("--big-layers", type=int, default=9, help="its layers (the preset's 8 make 29.4M parameters)")
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--broadcast", action="store_true", help="also run bench/broadcast.py's delta mode (root)")
    ap.add_argument("--broadcast-size-mb", type=float, default=200.0)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0, help="draws the traces' prompts and samples (one trace per seed)")
    ap.add_argument("--workdir", default=None, help="where the models are built and kept (reused when there)")
    args = ap.parse_args()
    from swarmrl.runtime.lifetime import interrupt_on_sigterm

    interrupt_on_sigterm()  # SIGTERM stops the broadcast run it started too (subprocess.run kills it on the way out)
    torch.set_num_threads(1)
    from rich.console import Console

    from swarmrl.modelcmd import build_and_warm, build_checkpoint
    from swarmrl.models.build import ModelConfig

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="swarmrl-deltas-"))
    work.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    t_start, cpu_start = time.time(), os.times()
    demo_ckpt = work / "demo-init"
    if not (demo_ckpt / "config.json").exists():
        build_and_warm(demo_ckpt, console=console)  # the demo's warm start (DemoConfig's default target)
    traces = {"demo": trace("demo", demo_ckpt, work, args.demo_lr, args.steps, args.prompts, args.group, 6,
                            task_reward=True, seed=1 + 100 * args.seed)}
    if not args.skip_big:
        big_ckpt = work / f"{args.big_size}-{args.big_layers}-init"
        if not (big_ckpt / "config.json").exists():
            build_checkpoint(big_ckpt, ModelConfig.preset(args.big_size, num_layers=args.big_layers), "bpe",
                             warmup_accuracy=0, console=console)
        traces["big"] = trace("big", big_ckpt, work, args.big_lr, args.steps, args.prompts, args.group, 8,
                              task_reward=False, seed=2 + 100 * args.seed)
    elapsed, cpu_end = time.time() - t_start, os.times()
    cpu_used = (cpu_end.user + cpu_end.system + cpu_end.children_user + cpu_end.children_system
                - cpu_start.user - cpu_start.system - cpu_start.children_user - cpu_start.children_system)
    load = os.getloadavg()

    for name, t in traces.items():
        for d in DTYPES:
            r = t[d]
            print(f"{name} ({t['parameters'] / 1e6:.2f}M, lr {t['lr']:g}) {d}: delta/full median "
                  f"{r['ratio_median']:.5f} "
                  f"(1/{1 / max(r['ratio_median'], 1e-12):.0f}), p90 {r['ratio_p90']:.5f}; plain XOR+zstd "
                  f"{r['plain_ratio_median']:.5f}; changed {r['changed_median']:.4f}; encode "
                  f"{r['encode_s_per_gb']:.2f} s/GB, apply {r['apply_s_per_gb']:.2f} s/GB; bit-identical "
                  f"{r['bit_identical']}", flush=True)
    big = traces.get("big")
    bcast = None
    if args.broadcast and big is not None:
        bcast = broadcast(big["bfloat16"]["changed_median"], args.broadcast_size_mb, args.nodes)
    identical = all(t[d]["bit_identical"] for t in traces.values() for d in DTYPES)
    # Per GB of the big model's checkpoints: the demo's 3 MB files measure fixed costs, not throughput.
    apply_rates = [t[d]["apply_s_per_gb"] for t in ([big] if big else traces.values()) for d in DTYPES]
    print(json.dumps({
        "delta_ratio_bf16_lr1e-6": round(big["bfloat16"]["ratio_median"], 6) if big else None,
        "delta_ratio_fp32_demo": round(traces["demo"]["float32"]["ratio_median"], 6),
        "apply_s_per_gb": round(max(apply_rates), 3),
        "bit_identical": identical,
        "broadcast_delta_vs_full": bcast.get("delta_vs_full") if bcast else None,
        "broadcast_delta_vs_full_last_shard": bcast.get("delta_vs_full_last_shard") if bcast else None,
        "steps": args.steps,
        "seed": args.seed,
        "wall_s": round(elapsed, 1),
        "cpu_busy_of_this_bench": round(cpu_used / max(elapsed, 1e-9), 2),
        "loadavg": [round(x, 2) for x in load],
        "traces": traces,
        "broadcast": {k: v for k, v in bcast.items() if k not in ("swarm", "delta")} if bcast else None,
    }))


if __name__ == "__main__":
    main()
