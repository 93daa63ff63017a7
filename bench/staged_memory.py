"""Benchmark: the memory that staged weight updates (`EngineConfig.staged_reload`, `node.vllm_staging`) cost a vLLM
node on the CPU, against vLLM's in-place reload on the same model.

Each arm is a fresh process (so one arm's allocations do not hide in the other's heap): it starts the vLLM engine on
version A, generates, prepares and loads version B (the staged arm; the other reloads B in place), generates again,
and reports its resident memory (`/proc/self/status` VmRSS) after the start, after the load and at its peak (VmHWM).
The arms alternate `--repeats` times. The weights' own size is reported beside them, so that the cost reads in
copies of the weights.

    python bench/staged_memory.py --model small30m --repeats 3

The last line printed is one JSON object: `weights_mib`; per arm (`staged`, `in_place`) the medians of `start_mib`,
`loaded_mib` and `peak_mib`; `extra_loaded_copies` and `extra_peak_copies` (staged minus in-place, in copies of the
weights); and every run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def rss_mib() -> tuple[float, float]:
    """(resident, peak resident) MiB of this process."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def make_versions(out: Path, model: str) -> tuple[Path, Path]:
    """Two checkpoints of one architecture (version B is A perturbed by 1%)."""
    from swarmrl.models.build import ModelConfig, build_model, save_checkpoint
    from swarmrl.models.tokenizers import build_bpe_tokenizer
    from swarmrl.testing.byzantine.harness import perturb_checkpoint

    tok = build_bpe_tokenizer(8192)
    a = save_checkpoint(build_model(ModelConfig.preset(model, arch="qwen2"), tok), tok, out / "a")
    return a, perturb_checkpoint(a, out / "b", 0.01)


def arm(staged: bool, a: Path, b: Path) -> dict[str, float]:
    """One arm in this process: start on A, generate, load B, generate; the memory at each point."""
    from swarmrl.node.engine import EngineConfig, GenerationRequest
    from swarmrl.node.engines import build_engine

    engine = build_engine(EngineConfig(kind="vllm", staged_reload=staged, kv_cache_gib=0.25), a, 0.7)
    staging = bool(getattr(engine, "staged", False))  # a vLLM engine's; a fallback is logged, not raised
    if staging != staged:
        raise SystemExit(f"staged_reload={staged} but the engine's staging is {staging}: see its log")
    requests = [GenerationRequest(prompt_ids=[5, 6, 7, 8], seed=s) for s in range(16)]
    engine.generate(requests, 16)
    start, _ = rss_mib()
    engine.prepare(b)  # the in-place arm prepares nothing
    engine.load(b)
    engine.generate(requests, 16)
    loaded, peak = rss_mib()
    engine.close()
    return {"start_mib": round(start, 1), "loaded_mib": round(loaded, 1), "peak_mib": round(peak, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small30m", choices=["mini", "small30m"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arm", choices=["staged", "in_place"], help=argparse.SUPPRESS)  # a child process's arm
    ap.add_argument("--ckpts", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(arm(args.arm == "staged", *args.ckpts)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        a, b = make_versions(Path(tmp), args.model)
        weights_mib = (a / "model.safetensors").stat().st_size / 2**20
        runs: dict[str, list[dict[str, float]]] = {"staged": [], "in_place": []}
        for r in range(args.repeats):
            for name in (("staged", "in_place") if r % 2 == 0 else ("in_place", "staged")):
                out = subprocess.run([sys.executable, __file__, "--arm", name, "--ckpts", str(a), str(b)],
                                     check=True, capture_output=True, text=True).stdout
                runs[name].append(json.loads(out.strip().splitlines()[-1]))
                print(name, runs[name][-1], file=sys.stderr, flush=True)
    med = {name: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for name, rs in runs.items()}
    print(json.dumps({
        "model": args.model, "weights_mib": round(weights_mib, 1), **med,
        "extra_loaded_copies": round((med["staged"]["loaded_mib"] - med["in_place"]["loaded_mib"]) / weights_mib, 2),
        "extra_peak_copies": round((med["staged"]["peak_mib"] - med["in_place"]["peak_mib"]) / weights_mib, 2),
        "runs": runs}))


if __name__ == "__main__":
    main()
